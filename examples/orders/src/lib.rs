//! # orders — an idem example service
//!
//! An order/payment HTTP service (axum) on SQLite or PostgreSQL whose pay
//! operation is guarded by three independent layers, so that even when one
//! of them fails nobody is charged twice:
//!
//! 1. **Edge: the `Idempotency-Key`** ([`idem_http::IdempotencyLayer`] on
//!    `POST /orders/{id}/pay`, records in the same database through
//!    [`idem_sql::SqliteStore`] / [`idem_sql::PostgresStore`]): a retried
//!    request gets the stored answer instead of running again; concurrent
//!    copies get 409 `in-flight`. The layer's [`idem_http::Fence`] (the
//!    claim's fencing token) is recorded per (scope, key) in `key_fences`
//!    by every write of the order, in the same transaction, and a write
//!    with a lower one is refused ([`Error::StaleFence`], 409
//!    `stale-fence`): a run that lost its key cannot write after a newer run.
//! 2. **Lock with fencing** ([`idem_core::lock::Lock`] over
//!    [`idem_sql::LeaseLockBackend`] on the same database, name
//!    `order-{id}`): one pay attempt per order at a time, whatever the keys;
//!    a busy order answers 409 `operation-in-progress` with `Retry-After`.
//!    Every write carries the lease's fence, and the writes refuse a fence
//!    lower than one already seen, so a holder paused past its lease cannot
//!    write late.
//! 3. **Database constraints and compare-and-set**: `orders.outer_order_no`
//!    is UNIQUE (create is insert-or-get,
//!    [`idem_sql::patterns::InsertOrGet`]); the status moves `PENDING →
//!    PAYING → PAID | PAYMENT_FAILED` only by compare-and-set
//!    ([`idem_sql::patterns::StateMachine`]); the provider's ledger has a
//!    UNIQUE provider key derived from the order (`order-{id}-attempt-{n}`),
//!    so a repeated provider call finds the existing charge.
//!
//! The payment provider is simulated ([`provider`]); the request header
//! `X-Simulate: fail | slow | lose-response` sets its behaviour for one pay
//! request. See `examples/orders/README.md` for a walk-through.
//!
//! ```no_run
//! # async fn run() -> Result<(), orders::Error> {
//! let app = orders::App::connect(orders::Config::new("sqlite://orders.db")).await?;
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:8080").await?;
//! axum::serve(listener, app.router()).await?;
//! # Ok(()) }
//! ```

pub mod db;
mod http_api;
pub mod provider;

use std::sync::Arc;
use std::time::Duration;

use idem_core::lock::{Acquire, Lock, LockError};
use idem_core::DynStore;
use idem_http::{IdempotencyLayer, TaskTracker};
use idem_sql::patterns::{PatternError, SqlValue, Transition};
use idem_sql::LeaseLockBackend;

pub use db::{status, CreateOutcome, Db, Fenced, KeyFence, Order, Orders};
pub use provider::{provider_key, Charge, ChargeOutcome, Provider, Simulate};

/// The workspace README's Rust snippets, compiled as doc tests of this crate
/// (whose dependencies cover them): `cargo test --doc -p orders`.
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
struct ReadmeSnippets;

/// Largest accepted amount, in cents (1 000 000.00).
pub const MAX_AMOUNT_CENTS: i64 = 100_000_000;
/// Longest accepted `outer_order_no`, in characters.
pub const MAX_ORDER_NO_LEN: usize = 64;

/// The result type of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Errors of the service.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A bad setting (database URL, schema name).
    #[error("configuration: {0}")]
    Config(String),
    /// The database failed.
    #[error("database: {0}")]
    Database(#[from] sqlx::Error),
    /// A SQL pattern failed.
    #[error("database: {0}")]
    Pattern(#[from] PatternError),
    /// The idempotency store failed to open.
    #[error("idempotency store: {0}")]
    Store(#[from] idem_core::StoreError),
    /// The lock failed.
    #[error("lock: {0}")]
    Lock(#[from] LockError),
    /// No such order.
    #[error("no order {0}")]
    NotFound(i64),
    /// Another pay attempt of the order holds its lock.
    #[error("a payment of this order is in progress; retry after {retry_after:?}")]
    Busy {
        /// When to try again.
        retry_after: Duration,
    },
    /// This holder's lock passed to a newer holder (a fence check refused
    /// its write); nothing was written.
    #[error("the order's lock passed to another attempt (fence {fence} < {current})")]
    LockLost {
        /// This holder's fence.
        fence: i64,
        /// The fence already recorded.
        current: i64,
    },
    /// A later run of the same idempotency key has written to the order
    /// (its `Idempotency-Fence` is higher): this run lost its key after an
    /// unknown outcome; nothing was written. Answered 409 `stale-fence`.
    #[error("a later run of this idempotency key has written (fence {fence} < {current}); nothing was written")]
    StaleFence {
        /// This run's fence.
        fence: i64,
        /// The highest fence recorded for the key.
        current: i64,
    },
    /// The order is in a state the pay flow did not expect (a concurrent
    /// writer outside the lock).
    #[error("order {id} is {status}")]
    Conflict {
        /// The order.
        id: i64,
        /// Its status.
        status: String,
    },
    /// The provider did not answer in time: the charge may or may not have
    /// happened. The order stays `PAYING`; the next pay resumes it with the
    /// same provider key.
    #[error(
        "the payment provider did not answer within {after:?}; outcome unknown, retry to resume"
    )]
    OutcomeUnknown {
        /// The order (status `PAYING`).
        order: Box<Order>,
        /// The timeout that passed.
        after: Duration,
    },
    /// I/O (binding a socket).
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
    /// A bug or an impossible state.
    #[error("internal: {0}")]
    Internal(String),
}

/// Settings of the service.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Config {
    /// `sqlite://FILE` or `postgres://USER@HOST:PORT/DB`.
    pub database_url: String,
    /// PostgreSQL only: the schema for every table (created when missing;
    /// default: the server's `search_path`, the store in `public`).
    pub schema: Option<String>,
    /// How long the service waits for the provider before it treats the
    /// outcome as unknown (default 3 s; `slow` takes 1.5 s).
    pub provider_timeout: Duration,
    /// TTL of the per-order lock (default 10 s; renewed at a third while
    /// the pay runs).
    pub lock_ttl: Duration,
    /// How long stored pay responses are replayed (default 24 h).
    pub idempotency_ttl: Duration,
}

impl Config {
    /// Defaults for the database at `database_url`.
    pub fn new(database_url: impl Into<String>) -> Self {
        Self {
            database_url: database_url.into(),
            schema: None,
            provider_timeout: Duration::from_secs(3),
            lock_ttl: Duration::from_secs(10),
            idempotency_ttl: Duration::from_secs(24 * 3600),
        }
    }

    /// Sets [`Self::schema`].
    pub fn with_schema(mut self, schema: impl Into<String>) -> Self {
        self.schema = Some(schema.into());
        self
    }

    /// Sets [`Self::provider_timeout`].
    pub fn with_provider_timeout(mut self, d: Duration) -> Self {
        self.provider_timeout = d;
        self
    }

    /// Sets [`Self::lock_ttl`].
    pub fn with_lock_ttl(mut self, d: Duration) -> Self {
        self.lock_ttl = d;
        self
    }
}

/// The lock name of order `id`.
pub fn lock_name(id: i64) -> String {
    format!("order-{id}")
}

/// The service: state shared by the handlers. Cheap to clone.
#[derive(Debug, Clone)]
pub struct App {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    config: Config,
    db: Db,
    orders: Orders,
    provider: Provider,
    lock: Lock<LeaseLockBackend>,
    layer: IdempotencyLayer,
}

impl App {
    /// Connects to the database, creates the tables (orders, provider,
    /// idempotency records, locks) when missing.
    ///
    /// Await it directly (e.g. in `main`): rustc cannot prove the future
    /// `Send` for PostgreSQL (`idem_sql::PostgresStore::from_pool_with`,
    /// sqlx's higher-ranked executor lifetimes), so it cannot be
    /// `tokio::spawn`ed. The router and every request are `Send`.
    ///
    /// # Errors
    /// [`Error::Config`], [`Error::Database`], [`Error::Store`],
    /// [`Error::Lock`].
    pub async fn connect(config: Config) -> Result<Self> {
        let db = Db::connect(&config.database_url, config.schema.as_deref()).await?;
        db.migrate().await?;
        let (store, backend): (DynStore, LeaseLockBackend) = match &db {
            Db::Sqlite(pool) => (
                Arc::new(idem_sql::SqliteStore::from_pool(pool.clone()).await?),
                LeaseLockBackend::sqlite(pool.clone()),
            ),
            Db::Postgres(pool) => {
                let opts = idem_sql::PostgresOptions::new(config.database_url.clone())
                    .with_schema(config.schema.clone().unwrap_or_else(|| "public".into()));
                (
                    Arc::new(idem_sql::PostgresStore::from_pool_with(pool.clone(), opts).await?),
                    LeaseLockBackend::postgres(pool.clone()),
                )
            }
        };
        backend.migrate().await?;
        let layer = IdempotencyLayer::from_parts(store, idem_http::Options::default())
            .with_require_key(true)
            .with_ttl(config.idempotency_ttl);
        Ok(Self {
            inner: Arc::new(Inner {
                orders: Orders::new(db.clone())?,
                provider: Provider::new(db.clone()),
                lock: Lock::new(backend),
                layer,
                db,
                config,
            }),
        })
    }

    /// The HTTP routes (see the crate docs and the README).
    pub fn router(&self) -> axum::Router {
        http_api::router(self.clone(), self.inner.layer.clone())
    }

    /// The tasks that run pay requests (the idempotency layer runs them
    /// detached from the connection); wait on it at shutdown.
    pub fn tracker(&self) -> &TaskTracker {
        self.inner.layer.tracker()
    }

    /// The scope the idempotency layer derives for a request with
    /// `headers` (`Scope::as_str`), under which [`KeyFence`]s are kept.
    pub fn key_scope(&self, headers: &http::HeaderMap) -> String {
        self.inner
            .layer
            .options()
            .scope
            .scope_of(headers)
            .as_str()
            .to_owned()
    }

    /// The settings.
    pub fn config(&self) -> &Config {
        &self.inner.config
    }

    /// The database pool.
    pub fn db(&self) -> &Db {
        &self.inner.db
    }

    /// The order table's operations.
    pub fn orders(&self) -> &Orders {
        &self.inner.orders
    }

    /// The simulated provider.
    pub fn provider(&self) -> &Provider {
        &self.inner.provider
    }

    /// The per-order lock.
    pub fn lock(&self) -> &Lock<LeaseLockBackend> {
        &self.inner.lock
    }

    /// Pays order `id` (layers 2 and 3; layer 1 is the HTTP layer): takes
    /// the order's lock, moves it to `PAYING` (a `PAYMENT_FAILED` order
    /// starts attempt n+1), calls the provider with the derived key
    /// `order-{id}-attempt-{n}` and the lock's fence, and records `PAID` or
    /// `PAYMENT_FAILED`. A `PAID` order is returned as it is (no charge); a
    /// `PAYING` order (an earlier outcome unknown) is resumed with the same
    /// key. Returns the order after the attempt.
    ///
    /// # Errors
    /// [`Error::NotFound`], [`Error::Busy`], [`Error::LockLost`],
    /// [`Error::OutcomeUnknown`], [`Error::Conflict`], database and lock
    /// errors.
    pub async fn pay(&self, id: i64, simulate: Simulate) -> Result<Order> {
        self.pay_as(id, None, simulate).await
    }

    /// [`Self::pay`] for a request that runs under an idempotency key's
    /// claim `key` (the layer's [`idem_http::Fence`]; `None` outside the
    /// layer): every write of the order also raises the key's recorded
    /// fence in the same transaction and is refused, with
    /// [`Error::StaleFence`], when a higher one is recorded — a later run
    /// of the key has written (docs/PROTOCOL.md, "Fences").
    ///
    /// # Errors
    /// As for [`Self::pay`], and [`Error::StaleFence`].
    pub async fn pay_as(
        &self,
        id: i64,
        key: Option<KeyFence>,
        simulate: Simulate,
    ) -> Result<Order> {
        if self.inner.orders.get(id).await?.is_none() {
            return Err(Error::NotFound(id));
        }
        let guard = match self
            .inner
            .lock
            .try_acquire(&lock_name(id), self.inner.config.lock_ttl)
            .await?
        {
            Acquire::Held(guard) => guard,
            Acquire::Busy { retry_after } => return Err(Error::Busy { retry_after }),
        };
        let fence = i64::try_from(guard.fence())
            .map_err(|_| Error::Internal(format!("fence {} out of range", guard.fence())))?;
        let result = self
            .pay_with_fences(id, fence, key.as_ref(), simulate)
            .await;
        if let Err(e) = guard.release().await {
            tracing::warn!(order = id, error = %e, "releasing the order lock failed; it ends at its TTL");
        }
        result
    }

    /// The pay flow for a caller that holds the order's lock with `fence`
    /// (see [`Self::pay`]). Public so tests can play a stale holder.
    ///
    /// # Errors
    /// As for [`Self::pay`] except `Busy`.
    pub async fn pay_with_fence(&self, id: i64, fence: i64, simulate: Simulate) -> Result<Order> {
        self.pay_with_fences(id, fence, None, simulate).await
    }

    /// The pay flow for a caller that holds the order's lock with `fence`
    /// and runs under the idempotency key claim `key` (see
    /// [`Self::pay_as`]). Public so tests can play a stale run.
    ///
    /// # Errors
    /// As for [`Self::pay_as`] except `Busy`.
    pub async fn pay_with_fences(
        &self,
        id: i64,
        fence: i64,
        key: Option<&KeyFence>,
        simulate: Simulate,
    ) -> Result<Order> {
        let orders = &self.inner.orders;
        let order = orders.get(id).await?.ok_or(Error::NotFound(id))?;
        let started = match order.status.as_str() {
            status::PAID => return Ok(order),
            status::PENDING => {
                orders
                    .transition_as(id, fence, key, &[status::PENDING], status::PAYING, &[])
                    .await?
            }
            status::PAYMENT_FAILED => {
                orders
                    .transition_as(
                        id,
                        fence,
                        key,
                        &[status::PAYMENT_FAILED],
                        status::PAYING,
                        &[("attempt", SqlValue::from(order.attempt + 1))],
                    )
                    .await?
            }
            // An attempt whose outcome is unknown: resume it (same key).
            status::PAYING => {
                orders
                    .transition_as(id, fence, key, &[status::PAYING], status::PAYING, &[])
                    .await?
            }
            other => {
                return Err(Error::Conflict {
                    id,
                    status: other.to_owned(),
                })
            }
        };
        self.check(id, fence, key, started).await?;
        let order = orders.get(id).await?.ok_or(Error::NotFound(id))?;
        if order.status == status::PAID {
            return Ok(order);
        }

        let provider_key = provider_key(id, order.attempt);
        let timeout = self.inner.config.provider_timeout;
        let call =
            self.inner
                .provider
                .charge(id, order.amount_cents, &provider_key, fence, simulate);
        let outcome = match tokio::time::timeout(timeout, call).await {
            Ok(outcome) => outcome?,
            Err(_) => {
                return Err(Error::OutcomeUnknown {
                    order: Box::new(order),
                    after: timeout,
                })
            }
        };
        let done = match outcome {
            ChargeOutcome::StaleFence { current } => {
                return Err(Error::LockLost { fence, current })
            }
            ChargeOutcome::Declined => {
                orders
                    .transition_as(
                        id,
                        fence,
                        key,
                        &[status::PAYING],
                        status::PAYMENT_FAILED,
                        &[],
                    )
                    .await?
            }
            ChargeOutcome::Charged { charge, .. } => {
                orders
                    .transition_as(
                        id,
                        fence,
                        key,
                        &[status::PAYING],
                        status::PAID,
                        &[("charge_id", SqlValue::from(charge.id))],
                    )
                    .await?
            }
        };
        self.check(id, fence, key, done).await?;
        orders.get(id).await?.ok_or(Error::NotFound(id))
    }

    async fn check(&self, id: i64, fence: i64, key: Option<&KeyFence>, t: Fenced) -> Result<()> {
        match t {
            Fenced::Stale { current } => Err(Error::LockLost { fence, current }),
            Fenced::StaleKey { current } => Err(Error::StaleFence {
                fence: key.map_or(0, |k| k.fence),
                current,
            }),
            Fenced::Done(Transition::Transitioned | Transition::AlreadyIn(_)) => Ok(()),
            Fenced::Done(Transition::NotFound) => Err(Error::NotFound(id)),
            Fenced::Done(Transition::Conflict(status)) => {
                if status == status::PAID {
                    Ok(())
                } else {
                    Err(Error::Conflict { id, status })
                }
            }
            #[allow(unreachable_patterns)]
            Fenced::Done(other) => Err(Error::Internal(format!("unexpected transition {other:?}"))),
        }
    }
}
