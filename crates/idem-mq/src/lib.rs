//! # idem-mq
//!
//! Process each message of an at-least-once broker **once**, keyed by
//! (consumer, stream/queue, partition, message id).
//!
//! Two ways, for two guarantees (see `docs/patterns/consumers.md`):
//!
//! | path | guarantee | use for |
//! |---|---|---|
//! | [`SqlInbox`] / [`inbox::Inbox`] (feature `sql`, default) | **exactly-once effect**: the "processed" row commits in the same transaction as the handler's writes; ack after commit | money, and every effect that lives in that SQL database |
//! | [`Dedup`] over any [`idem_core::Store`] | at most one *successful* run per id within the retention window while the store holds its record | effects outside the database (an e-mail, an HTTP call), where the effect and the record cannot share a commit |
//!
//! [`Dedup`] claims the message id with [`Store::begin`] (scope = consumer
//! [+ stream + partition], key = message id), runs the handler, and on
//! success completes the record with an empty response for the retention
//! window; a failed handler releases the claim so the redelivery runs; a
//! claim whose lease ran out (the consumer crashed) is taken over by the next
//! delivery; a live claim answers [`Outcome::InFlight`] and the message is
//! left for redelivery, never run twice at the same time. Its crash window:
//! a crash after the handler's effect and before `complete` leaves the claim
//! in flight until its lease ends, then the message runs **again**. Only the
//! inbox closes that window.
//!
//! Adapters: [`nats`] (feature `nats`, JetStream pull consumers, explicit
//! ack) and [`amqp`] (feature `amqp`, RabbitMQ with manual acks). Both ack
//! only after the processor returned [`Outcome::Applied`] or
//! [`Outcome::Duplicate`] (for the inbox: after the commit), nack on failure
//! and handle each message of a batch on its own.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use idem_core::{
    Begin, BeginRequest, Fingerprint, IdempotencyKey, Scope, Store, StoreError, StoredResponse,
};

mod identity;
#[cfg(feature = "sql")]
mod sql;

#[cfg(feature = "amqp")]
pub mod amqp;
#[cfg(feature = "nats")]
pub mod nats;

pub use idem_core::BoxError;
#[cfg(feature = "sql")]
pub use idem_sql::inbox;
pub use identity::{IdError, IdExtractor, IdSource, Incoming, MessageKey, MissingIdPolicy};
#[cfg(feature = "sql")]
#[doc(hidden)]
pub use sql::__private;
#[cfg(feature = "sql")]
pub use sql::{SqlInbox, TxHandler};

/// A message as handlers see it: its key (absent only when the adapter's
/// [`MissingIdPolicy::ProcessWithoutDedup`] let an id-less message through),
/// its payload, and how often the broker says it was delivered.
#[derive(Debug, Clone)]
pub struct Message {
    /// The dedup key; `None` for an id-less message processed without dedup.
    pub key: Option<MessageKey>,
    /// The payload bytes.
    pub payload: Vec<u8>,
    /// Delivery attempt as the broker reports it (NATS: `delivered`, 1-based);
    /// RabbitMQ only says "redelivered" (2) or not (1).
    pub delivery_attempt: u64,
}

/// What processing one message came to. The adapters turn it into an ack
/// or a nack ([`Outcome::disposition`]).
#[derive(Debug)]
#[non_exhaustive]
pub enum Outcome {
    /// The handler ran and its effect is recorded: ack.
    Applied,
    /// Processed before (within the retention window): the handler did not
    /// run. Ack.
    Duplicate,
    /// Another delivery of the same message is being processed right now
    /// (its lease is live): do not ack; redeliver after `retry_after`.
    InFlight {
        /// Time left on the other holder's lease.
        retry_after: Duration,
    },
    /// The handler or the dedup record failed: do not ack; redeliver.
    Failed(BoxError),
}

/// What an adapter does with a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Disposition {
    /// Acknowledge: never deliver it again.
    Ack,
    /// Negative-acknowledge: deliver it again, after `delay` where the broker
    /// supports it (NATS `-NAK {delay}`; RabbitMQ requeues once the adapter
    /// waited the delay).
    Retry {
        /// How long to wait first.
        delay: Duration,
    },
    /// Refuse without requeue (NATS `+TERM`; RabbitMQ `basic.reject
    /// requeue=false`, which dead-letters it where the queue has a
    /// dead-letter exchange).
    Reject,
}

impl Outcome {
    /// The disposition: `Applied`/`Duplicate` → ack; `InFlight` → retry after
    /// the holder's lease (at least `retry_delay`); `Failed` → retry after
    /// `retry_delay`.
    pub fn disposition(&self, retry_delay: Duration) -> Disposition {
        match self {
            Outcome::Applied | Outcome::Duplicate => Disposition::Ack,
            Outcome::InFlight { retry_after } => Disposition::Retry {
                delay: (*retry_after).max(retry_delay),
            },
            Outcome::Failed(_) => Disposition::Retry { delay: retry_delay },
        }
    }
}

/// Processes one message and says what to do with it. [`Dedup`] with a
/// [`MessageHandler`], and [`SqlInbox`] with a [`TxHandler`], implement it;
/// so can your own code.
#[async_trait]
pub trait Processor: Send + Sync {
    /// Processes `msg` (at most once per key, however the implementation
    /// guarantees it).
    async fn process(&self, msg: &Message) -> Outcome;
}

#[async_trait]
impl<P: Processor + ?Sized> Processor for Arc<P> {
    async fn process(&self, msg: &Message) -> Outcome {
        (**self).process(msg).await
    }
}

/// A handler of messages with no transaction to share (the [`Dedup`] path).
#[async_trait]
pub trait MessageHandler: Send + Sync {
    /// Applies the message's effect. An error releases the claim: the
    /// redelivery runs it again.
    async fn handle(&self, msg: &Message) -> Result<(), BoxError>;
}

/// A [`MessageHandler`] from an async closure taking an owned [`Message`]
/// (see [`handler_fn`]).
pub struct HandlerFn<F>(F);

impl<F> fmt::Debug for HandlerFn<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("HandlerFn")
    }
}

/// Wraps `f(Message) -> impl Future<Output = Result<(), BoxError>>` as a
/// [`MessageHandler`].
pub fn handler_fn<F, Fut>(f: F) -> HandlerFn<F>
where
    F: Fn(Message) -> Fut + Send + Sync,
    Fut: std::future::Future<Output = Result<(), BoxError>> + Send,
{
    HandlerFn(f)
}

#[async_trait]
impl<F, Fut> MessageHandler for HandlerFn<F>
where
    F: Fn(Message) -> Fut + Send + Sync,
    Fut: std::future::Future<Output = Result<(), BoxError>> + Send,
{
    async fn handle(&self, msg: &Message) -> Result<(), BoxError> {
        (self.0)(msg.clone()).await
    }
}

/// Settings of [`Dedup`], checked by [`DedupOptions::validate`] (and so by
/// [`Dedup::with_options`]).
#[derive(Debug, Clone, Copy)]
pub struct DedupOptions {
    /// How long a claim holds before the next delivery may take it over
    /// (the consumer crashed). Must exceed the handler's longest run, or a
    /// slow handler's message runs twice. Default 30 s; at least
    /// [`idem_core::MIN_LEASE`] (1 s): a zero lease would let every copy
    /// of a message run. Millisecond precision; long leases saturate (up
    /// to `Duration::MAX`).
    pub lease: Duration,
    /// How long a processed message is remembered. A redelivery after this
    /// **runs again**: keep it above the broker's longest redelivery
    /// horizon. Default 7 days; at least [`MIN_RETENTION`] (1 s): a zero
    /// retention would forget each message as soon as it is processed.
    /// Millisecond precision; long ones saturate (up to `Duration::MAX`:
    /// kept until the store deletes it).
    pub retention: Duration,
}

/// The shortest [`DedupOptions::retention`]: 1 s.
pub const MIN_RETENTION: Duration = Duration::from_secs(1);

/// Why [`DedupOptions`] were refused ([`DedupOptions::validate`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DedupOptionsError {
    /// The lease is shorter than [`idem_core::MIN_LEASE`] (1 s).
    #[error("the dedup lease ({lease:?}) is shorter than the minimum of {min:?}: a claim could end before its handler runs, and copies of a message would run again")]
    LeaseTooShort {
        /// The lease given.
        lease: Duration,
        /// [`idem_core::MIN_LEASE`].
        min: Duration,
    },
    /// The retention is shorter than [`MIN_RETENTION`] (1 s).
    #[error("the dedup retention ({retention:?}) is shorter than the minimum of {min:?}: a processed message would be forgotten at once, and its redelivery run again")]
    RetentionTooShort {
        /// The retention given.
        retention: Duration,
        /// [`MIN_RETENTION`].
        min: Duration,
    },
}

impl DedupOptions {
    /// Checks the settings: a lease of at least [`idem_core::MIN_LEASE`]
    /// (1 s) and a retention of at least [`MIN_RETENTION`] (1 s). Longer
    /// values, up to `Duration::MAX`, are accepted.
    ///
    /// ```
    /// use std::time::Duration;
    /// use idem_mq::{DedupOptions, DedupOptionsError};
    /// assert!(DedupOptions::default().validate().is_ok());
    /// let zero = DedupOptions { retention: Duration::ZERO, ..DedupOptions::default() };
    /// assert!(matches!(zero.validate(), Err(DedupOptionsError::RetentionTooShort { .. })));
    /// ```
    ///
    /// # Errors
    /// [`DedupOptionsError::LeaseTooShort`],
    /// [`DedupOptionsError::RetentionTooShort`].
    pub fn validate(&self) -> Result<(), DedupOptionsError> {
        if self.lease < idem_core::MIN_LEASE {
            return Err(DedupOptionsError::LeaseTooShort {
                lease: self.lease,
                min: idem_core::MIN_LEASE,
            });
        }
        if self.retention < MIN_RETENTION {
            return Err(DedupOptionsError::RetentionTooShort {
                retention: self.retention,
                min: MIN_RETENTION,
            });
        }
        Ok(())
    }
}

impl Default for DedupOptions {
    fn default() -> Self {
        Self {
            lease: Duration::from_secs(30),
            retention: Duration::from_secs(7 * 24 * 3600),
        }
    }
}

/// The answer of [`Dedup::run`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DedupOutcome<T> {
    /// The operation ran and the message is recorded as processed.
    Applied(T),
    /// Processed before: the operation did not run.
    Duplicate,
    /// Another delivery holds a live claim: the operation did not run.
    InFlight {
        /// Time left on that claim.
        retry_after: Duration,
    },
}

/// The error of [`Dedup::run`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DedupError<E> {
    /// The operation failed; the claim was released (the redelivery runs it).
    #[error("message handler failed")]
    Handler(#[source] E),
    /// The store failed. At `begin` the operation did not run; at `complete`
    /// it **did** run and the record may be missing (a redelivery after the
    /// lease may run it again).
    #[error("dedup store failed")]
    Store(#[source] StoreError),
    /// The key's record in this scope was written with another fingerprint:
    /// something other than idem-mq uses the scope. The operation did not run.
    #[error("the dedup key is in use by a different kind of record (fingerprint mismatch)")]
    Mismatch,
}

/// Message dedup over any [`Store`]: at most one successful run per
/// [`MessageKey`] within [`DedupOptions::retention`].
#[derive(Debug, Clone)]
pub struct Dedup<S, H = ()> {
    store: S,
    options: DedupOptions,
    handler: H,
}

/// The fingerprint every [`Dedup`] record carries: a constant (SHA-256 of
/// `idem-mq/message`), since a message is identified by its key alone. A
/// record in the same scope with another fingerprint is
/// [`DedupError::Mismatch`].
pub fn message_fingerprint() -> Fingerprint {
    Fingerprint::of(b"idem-mq/message")
}

impl<S: Store> Dedup<S, ()> {
    /// Dedup over `store` with default options and no handler (use
    /// [`Self::run`], or add one with [`Self::with_handler`] to get a [`Processor`]).
    pub fn new(store: S) -> Self {
        Self {
            store,
            options: DedupOptions::default(),
            handler: (),
        }
    }
}

impl<S: Store, H> Dedup<S, H> {
    /// Sets the options, checked first ([`DedupOptions::validate`]).
    ///
    /// # Errors
    /// [`DedupOptionsError`] for a lease or retention under 1 s (the
    /// options in force are left as they were).
    pub fn with_options(mut self, options: DedupOptions) -> Result<Self, DedupOptionsError> {
        options.validate()?;
        self.options = options;
        Ok(self)
    }

    /// Sets the handler, making this a [`Processor`].
    pub fn with_handler<H2: MessageHandler>(self, handler: H2) -> Dedup<S, H2> {
        Dedup {
            store: self.store,
            options: self.options,
            handler,
        }
    }

    /// The store.
    pub fn store(&self) -> &S {
        &self.store
    }

    /// The handler.
    pub fn handler(&self) -> &H {
        &self.handler
    }

    /// The options.
    pub fn options(&self) -> &DedupOptions {
        &self.options
    }

    /// Runs `op` unless `key` was processed or is being processed:
    /// `begin` → `op` → `complete` (empty response, ttl = retention), or
    /// `release` when `op` fails.
    ///
    /// # Errors
    /// [`DedupError::Handler`] (claim released), [`DedupError::Store`],
    /// [`DedupError::Mismatch`].
    pub async fn run<T, E, F, Fut>(
        &self,
        key: &MessageKey,
        op: F,
    ) -> Result<DedupOutcome<T>, DedupError<E>>
    where
        F: FnOnce() -> Fut + Send,
        Fut: std::future::Future<Output = Result<T, E>> + Send,
    {
        let req = BeginRequest {
            scope: key.scope(),
            key: key.idempotency_key(),
            fingerprint: message_fingerprint(),
            lease: self.options.lease,
        };
        let lease = match self.store.begin(&req).await.map_err(DedupError::Store)? {
            Begin::Acquired(lease) => lease,
            Begin::Replay(_) => return Ok(DedupOutcome::Duplicate),
            Begin::InFlight { retry_after } => return Ok(DedupOutcome::InFlight { retry_after }),
            Begin::Mismatch => return Err(DedupError::Mismatch),
        };
        match op().await {
            Ok(v) => {
                self.store
                    .complete(
                        &lease,
                        &StoredResponse::new(200, Vec::new()),
                        self.options.retention,
                    )
                    .await
                    .map_err(DedupError::Store)?;
                Ok(DedupOutcome::Applied(v))
            }
            Err(e) => {
                if let Err(err) = self.store.release(&lease).await {
                    // The claim stays until its lease ends; the redelivery
                    // after that runs the message.
                    tracing::warn!(error = %err, "idem-mq: releasing a failed message's claim failed");
                }
                Err(DedupError::Handler(e))
            }
        }
    }

    /// Whether `key` is recorded as processed (within retention).
    ///
    /// # Errors
    /// The store's.
    pub async fn is_processed(&self, key: &MessageKey) -> Result<bool, StoreError> {
        let rec = self.store.get(&key.scope(), &key.idempotency_key()).await?;
        Ok(matches!(
            rec.map(|r| r.state),
            Some(idem_core::RecordState::Completed { .. })
        ))
    }
}

#[async_trait]
impl<S: Store, H: MessageHandler> Processor for Dedup<S, H> {
    async fn process(&self, msg: &Message) -> Outcome {
        let Some(key) = &msg.key else {
            // Let through by MissingIdPolicy::ProcessWithoutDedup.
            return match self.handler.handle(msg).await {
                Ok(()) => Outcome::Applied,
                Err(e) => Outcome::Failed(e),
            };
        };
        match self.run(key, || self.handler.handle(msg)).await {
            Ok(DedupOutcome::Applied(())) => Outcome::Applied,
            Ok(DedupOutcome::Duplicate) => Outcome::Duplicate,
            Ok(DedupOutcome::InFlight { retry_after }) => Outcome::InFlight { retry_after },
            Err(DedupError::Handler(e)) => Outcome::Failed(e),
            Err(DedupError::Store(e)) => Outcome::Failed(Box::new(e)),
            Err(DedupError::Mismatch) => {
                Outcome::Failed(DedupError::<StoreError>::Mismatch.to_string().into())
            }
        }
    }
}

/// Counts of what a consumer did with the messages it got.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Report {
    /// Messages received from the broker.
    pub received: u64,
    /// Handlers run with their effect recorded (and acked).
    pub applied: u64,
    /// Duplicates skipped (and acked).
    pub duplicates: u64,
    /// Left for redelivery because another delivery held them.
    pub in_flight: u64,
    /// Failed and left for redelivery.
    pub failed: u64,
    /// Refused without requeue (no message id under [`MissingIdPolicy::Reject`]).
    pub rejected: u64,
    /// Acks / nacks the broker did not take (the message will come again;
    /// the dedup record makes that harmless).
    pub ack_errors: u64,
}

impl Report {
    /// Adds `other`'s counts.
    pub fn merge(&mut self, other: &Report) {
        self.received += other.received;
        self.applied += other.applied;
        self.duplicates += other.duplicates;
        self.in_flight += other.in_flight;
        self.failed += other.failed;
        self.rejected += other.rejected;
        self.ack_errors += other.ack_errors;
    }

    /// Counts one outcome (`received` is not touched).
    pub fn count(&mut self, outcome: &Outcome) {
        match outcome {
            Outcome::Applied => self.applied += 1,
            Outcome::Duplicate => self.duplicates += 1,
            Outcome::InFlight { .. } => self.in_flight += 1,
            Outcome::Failed(_) => self.failed += 1,
        }
    }
}

/// A [`Scope`] or key could not be built: never expected (names are bounded
/// and hashed when long), kept typed instead of a panic.
pub(crate) fn scope_of(name: String) -> Scope {
    Scope::new(name.clone()).unwrap_or_else(|_| Scope::hashed([name.as_bytes()]))
}

pub(crate) fn key_of(id: &str) -> IdempotencyKey {
    IdempotencyKey::new(id).unwrap_or_else(|_| {
        IdempotencyKey::new(format!(
            "sha256:{}",
            Fingerprint::of(id.as_bytes()).to_hex()
        ))
        .expect("71 visible ASCII characters")
    })
}

/// One delivery, as both adapters run it: `processor` on `message` (or the
/// rejection of an id-less one), then `settle` with the disposition; the
/// report counts the outcome and an ack `settle` could not make. `requeue`
/// and `reject` say in the log what the broker does with a failed or an
/// id-less message.
#[cfg(any(feature = "amqp", feature = "nats"))]
pub(crate) async fn run_delivery<P, S, E>(
    processor: &P,
    message: Result<Message, IdError>,
    retry_delay: Duration,
    (requeue, reject): (&str, &str),
    settle: impl FnOnce(Disposition) -> S,
) -> Report
where
    P: Processor + ?Sized,
    S: std::future::Future<Output = Result<(), E>>,
    E: fmt::Display,
{
    let mut report = Report {
        received: 1,
        ..Report::default()
    };
    let disposition = match message {
        Ok(m) => {
            let outcome = processor.process(&m).await;
            if let Outcome::Failed(e) = &outcome {
                tracing::warn!(error = %e, "idem-mq: handler failed; the message will be {requeue}");
            }
            report.count(&outcome);
            outcome.disposition(retry_delay)
        }
        Err(e) => {
            tracing::warn!(error = %e, "idem-mq: message without id {reject}");
            report.rejected += 1;
            Disposition::Reject
        }
    };
    if let Err(e) = settle(disposition).await {
        tracing::warn!(error = %e, "idem-mq: ack failed; the message will be redelivered");
        report.ack_errors += 1;
    }
    report
}
