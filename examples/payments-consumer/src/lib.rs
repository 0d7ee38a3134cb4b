//! # payments-consumer (example)
//!
//! Credits accounts from "payment captured" messages — JSON
//! `{"payment_id": "…", "account": "…", "amount_cents": 500}` — exactly
//! once, through the SQL inbox of `idem-mq`: the inbox row, the credit row
//! and the balance update commit in one transaction, and the message is
//! acked only after that commit. A redelivered or re-published payment is
//! acked without crediting again.
//!
//! Databases: SQLite (`sqlite://payments.db`) or PostgreSQL
//! (`postgres://…`). Brokers: NATS JetStream (`nats://…`; the message id is
//! the `Nats-Msg-Id` header) or RabbitMQ (`amqp://…`; the `message_id`
//! property). [`publish`] sets the id to the payment id.
//!
//! ```text
//! payments-consumer consume --broker nats://127.0.0.1:4222 --database sqlite://payments.db
//! payments-consumer publish --broker nats://127.0.0.1:4222 --payment-id p-1 --account alice --amount-cents 500
//! ```

use std::future::Future;
use std::str::FromStr;
use std::time::Duration;

use async_trait::async_trait;
use idem_mq::inbox::{Inbox, InboxOptions};
use idem_mq::{BoxError, Message, Outcome, Processor, Report, SqlInbox};
use serde::{Deserialize, Serialize};

/// The message: a payment was captured; credit `account` by `amount_cents`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PaymentCaptured {
    /// The payment's id (also the message id the publisher sets).
    pub payment_id: String,
    /// The account to credit.
    pub account: String,
    /// The amount, in cents (> 0).
    pub amount_cents: i64,
}

/// The example's errors.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A URL names no supported database or broker.
    #[error("unsupported URL {0:?}: use sqlite://… or postgres://… for --database, nats://… or amqp://… for --broker")]
    UnsupportedUrl(String),
    /// The database failed.
    #[error("database error")]
    Database(#[from] sqlx::Error),
    /// The inbox failed.
    #[error("inbox error")]
    Inbox(#[from] idem_mq::inbox::InboxError),
    /// The broker failed.
    #[error("broker error: {0}")]
    Broker(#[source] BoxError),
}

fn broker<E: std::error::Error + Send + Sync + 'static>(e: E) -> Error {
    Error::Broker(Box::new(e))
}

/// The handler: records the credit and moves the balance, on the inbox's
/// transaction.
#[derive(Debug, Clone, Copy, Default)]
pub struct Credit;

fn parse(msg: &Message) -> Result<PaymentCaptured, BoxError> {
    let p: PaymentCaptured = serde_json::from_slice(&msg.payload)?;
    if p.amount_cents <= 0 {
        return Err(format!("payment {}: amount_cents must be > 0", p.payment_id).into());
    }
    Ok(p)
}

// `TxHandler` for each database, with the two statements in its placeholder
// syntax: insert the credit, then add it to the balance.
idem_mq::tx_handler!(Credit, |_this, tx, msg, sql| {
    let (insert_credit, add_to_balance) = sql;
    let p = parse(msg)?;
    sqlx::query(insert_credit)
        .bind(&p.payment_id)
        .bind(&p.account)
        .bind(p.amount_cents)
        .execute(&mut **tx)
        .await?;
    sqlx::query(add_to_balance)
        .bind(&p.account)
        .bind(p.amount_cents)
        .execute(&mut **tx)
        .await?;
    Ok(())
},
    sqlx::Sqlite => (
        "INSERT INTO credits (payment_id, account, amount_cents) VALUES (?1, ?2, ?3)",
        "INSERT INTO accounts (account, balance_cents) VALUES (?1, ?2) \
         ON CONFLICT (account) DO UPDATE SET balance_cents = accounts.balance_cents + excluded.balance_cents",
    ),
    sqlx::Postgres => (
        "INSERT INTO credits (payment_id, account, amount_cents) VALUES ($1, $2, $3)",
        "INSERT INTO accounts (account, balance_cents) VALUES ($1, $2) \
         ON CONFLICT (account) DO UPDATE SET balance_cents = accounts.balance_cents + excluded.balance_cents",
    ),
);

/// Creates the ledger's tables on `$pool`, then the inbox over it
/// (migrated) with the [`Credit`] handler.
macro_rules! ledger_inbox {
    ($pool:expr) => {{
        let pool = $pool;
        for s in SCHEMA {
            sqlx::query(s).execute(&pool).await?;
        }
        let inbox = Inbox::with_options(pool, InboxOptions::default())?;
        inbox.migrate().await?;
        SqlInbox::new(inbox, Credit)
    }};
}

/// One `sqlx::query_scalar` on a [`Ledger`]'s pool: the statement in the
/// pool's placeholder syntax (`$sqlite` or `$postgres`), bound to `$arg`,
/// fetched with `$fetch` (`fetch_one`, `fetch_optional`).
macro_rules! ledger_scalar {
    (@on $pool:expr, $sql:literal, $arg:expr, $fetch:ident) => {
        sqlx::query_scalar($sql).bind($arg).$fetch($pool).await?
    };
    ($ledger:expr, $sqlite:literal, $postgres:literal, $arg:expr, $fetch:ident) => {
        match $ledger {
            Ledger::Sqlite(p) => ledger_scalar!(@on p.inbox().pool(), $sqlite, $arg, $fetch),
            Ledger::Postgres(p) => ledger_scalar!(@on p.inbox().pool(), $postgres, $arg, $fetch),
        }
    };
}

const SCHEMA: [&str; 2] = [
    "CREATE TABLE IF NOT EXISTS accounts (account VARCHAR(255) PRIMARY KEY, balance_cents BIGINT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS credits (payment_id VARCHAR(255) NOT NULL, account VARCHAR(255) NOT NULL, amount_cents BIGINT NOT NULL)",
];

/// The ledger database with its inbox: SQLite or PostgreSQL.
#[derive(Debug)]
pub enum Ledger {
    /// `sqlite://…`
    Sqlite(SqlInbox<sqlx::Sqlite, Credit>),
    /// `postgres://…`
    Postgres(SqlInbox<sqlx::Postgres, Credit>),
}

impl Ledger {
    /// Connects to `url` (`sqlite://file.db`, created if missing, or
    /// `postgres://…`) and creates the tables (`accounts`, `credits`, the
    /// inbox `idem_inbox`) if missing.
    ///
    /// # Errors
    /// [`Error::UnsupportedUrl`], [`Error::Database`], [`Error::Inbox`].
    pub async fn open(url: &str) -> Result<Self, Error> {
        if url.starts_with("sqlite:") {
            let opts = sqlx::sqlite::SqliteConnectOptions::from_str(url)?
                .create_if_missing(true)
                .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
                .busy_timeout(Duration::from_secs(10));
            let pool = sqlx::sqlite::SqlitePoolOptions::new()
                .connect_with(opts)
                .await?;
            Ok(Self::Sqlite(ledger_inbox!(pool)))
        } else if url.starts_with("postgres:") || url.starts_with("postgresql:") {
            let pool = sqlx::postgres::PgPoolOptions::new()
                .acquire_timeout(Duration::from_secs(10))
                .connect(url)
                .await?;
            Ok(Self::Postgres(ledger_inbox!(pool)))
        } else {
            Err(Error::UnsupportedUrl(url.to_owned()))
        }
    }

    /// The balance of `account` in cents (0 when it has none).
    ///
    /// # Errors
    /// [`Error::Database`].
    pub async fn balance(&self, account: &str) -> Result<i64, Error> {
        let b: Option<i64> = ledger_scalar!(
            self,
            "SELECT balance_cents FROM accounts WHERE account = ?1",
            "SELECT balance_cents FROM accounts WHERE account = $1",
            account,
            fetch_optional
        );
        Ok(b.unwrap_or(0))
    }

    /// How many credits were recorded for `payment_id` (1 after any number
    /// of deliveries).
    ///
    /// # Errors
    /// [`Error::Database`].
    pub async fn credits_for(&self, payment_id: &str) -> Result<i64, Error> {
        Ok(ledger_scalar!(
            self,
            "SELECT count(*) FROM credits WHERE payment_id = ?1",
            "SELECT count(*) FROM credits WHERE payment_id = $1",
            payment_id,
            fetch_one
        ))
    }

    /// Deletes inbox rows older than `age` (see the retention warning in
    /// `docs/patterns/consumers.md`).
    ///
    /// # Errors
    /// [`Error::Inbox`].
    pub async fn purge_older_than(&self, age: Duration) -> Result<u64, Error> {
        Ok(match self {
            Ledger::Sqlite(p) => p.inbox().purge_older_than(age).await?,
            Ledger::Postgres(p) => p.inbox().purge_older_than(age).await?,
        })
    }
}

#[async_trait]
impl Processor for Ledger {
    async fn process(&self, msg: &Message) -> Outcome {
        match self {
            Ledger::Sqlite(p) => p.process(msg).await,
            Ledger::Postgres(p) => p.process(msg).await,
        }
    }
}

/// Where to consume from and as whom.
#[derive(Debug, Clone)]
pub struct Source {
    /// `nats://…` or `amqp://…`.
    pub broker: String,
    /// NATS: the stream (created if missing). Default `PAYMENTS`.
    pub stream: String,
    /// NATS: the subject (the stream's subject); RabbitMQ: the queue
    /// (declared durable if missing). Default `payments.captured`.
    pub subject: String,
    /// The consumer name: the JetStream durable consumer and the dedup
    /// scope. Default `payments-consumer`.
    pub consumer: String,
}

impl Source {
    /// Defaults for `broker`.
    pub fn new(broker: impl Into<String>) -> Self {
        Self {
            broker: broker.into(),
            stream: "PAYMENTS".into(),
            subject: "payments.captured".into(),
            consumer: "payments-consumer".into(),
        }
    }
}

/// Consumes from `source` through `ledger` until `shutdown` completes.
///
/// # Errors
/// [`Error::UnsupportedUrl`], [`Error::Broker`].
pub async fn consume<F: Future<Output = ()>>(
    source: &Source,
    ledger: Ledger,
    shutdown: F,
) -> Result<Report, Error> {
    if source.broker.starts_with("nats://") {
        use async_nats::jetstream::{self, consumer::pull};
        let client = async_nats::connect(&source.broker).await.map_err(broker)?;
        let js = jetstream::new(client);
        let stream = js
            .get_or_create_stream(jetstream::stream::Config {
                name: source.stream.clone(),
                subjects: vec![source.subject.clone()],
                ..Default::default()
            })
            .await
            .map_err(broker)?;
        let consumer = stream
            .get_or_create_consumer(
                &source.consumer,
                pull::Config {
                    durable_name: Some(source.consumer.clone()),
                    ack_policy: jetstream::consumer::AckPolicy::Explicit,
                    ..Default::default()
                },
            )
            .await
            .map_err(broker)?;
        let c = idem_mq::nats::NatsConsumer::new(
            consumer,
            ledger,
            idem_mq::nats::NatsOptions::default(),
        );
        c.run_until(shutdown).await.map_err(broker)
    } else if source.broker.starts_with("amqp://") {
        let (conn, ch) = amqp_channel(&source.broker, &source.subject).await?;
        let c = idem_mq::amqp::AmqpConsumer::new(
            ch,
            source.subject.clone(),
            ledger,
            idem_mq::amqp::AmqpOptions::new(source.consumer.clone()),
        );
        let report = c.run_until(shutdown).await.map_err(broker)?;
        let _ = conn.close(200, "bye").await;
        Ok(report)
    } else {
        Err(Error::UnsupportedUrl(source.broker.clone()))
    }
}

async fn amqp_channel(
    url: &str,
    queue: &str,
) -> Result<(lapin::Connection, lapin::Channel), Error> {
    use lapin::options::QueueDeclareOptions;
    let conn = lapin::Connection::connect(url, lapin::ConnectionProperties::default())
        .await
        .map_err(broker)?;
    let ch = conn.create_channel().await.map_err(broker)?;
    ch.queue_declare(
        queue,
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        lapin::types::FieldTable::default(),
    )
    .await
    .map_err(broker)?;
    Ok((conn, ch))
}

/// Publishes `payment` to `source` with its `payment_id` as the message id
/// (`Nats-Msg-Id` / AMQP `message_id`), waiting for the broker's confirm.
///
/// # Errors
/// [`Error::UnsupportedUrl`], [`Error::Broker`].
pub async fn publish(source: &Source, payment: &PaymentCaptured) -> Result<(), Error> {
    let body = serde_json::to_vec(payment).map_err(broker)?;
    if source.broker.starts_with("nats://") {
        use async_nats::jetstream::{self, message::PublishMessage};
        let client = async_nats::connect(&source.broker).await.map_err(broker)?;
        let js = jetstream::new(client);
        js.get_or_create_stream(jetstream::stream::Config {
            name: source.stream.clone(),
            subjects: vec![source.subject.clone()],
            ..Default::default()
        })
        .await
        .map_err(broker)?;
        let msg = PublishMessage::build()
            .payload(body.into())
            .message_id(&payment.payment_id);
        js.send_publish(source.subject.clone(), msg)
            .await
            .map_err(broker)?
            .await
            .map_err(broker)?;
        Ok(())
    } else if source.broker.starts_with("amqp://") {
        use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
        let (conn, ch) = amqp_channel(&source.broker, &source.subject).await?;
        ch.confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(broker)?;
        let props = lapin::BasicProperties::default()
            .with_message_id(payment.payment_id.as_str().into())
            .with_delivery_mode(2);
        ch.basic_publish(
            "",
            &source.subject,
            BasicPublishOptions::default(),
            &body,
            props,
        )
        .await
        .map_err(broker)?
        .await
        .map_err(broker)?;
        let _ = conn.close(200, "bye").await;
        Ok(())
    } else {
        Err(Error::UnsupportedUrl(source.broker.clone()))
    }
}
