//! NATS JetStream pull consumers (feature `nats`, crate `async-nats`).
//!
//! The JetStream consumer must use explicit acks (`AckPolicy::Explicit`, the
//! pull default). Each batch fetches up to [`NatsOptions::batch`] messages;
//! each message is processed and acked on its own, so a duplicate or a
//! failure inside a batch does not hold back the rest:
//!
//! | [`Outcome`] | JetStream |
//! |---|---|
//! | `Applied`, `Duplicate` | `+ACK` (after the inbox commit) |
//! | `InFlight` | `-NAK {"delay": lease left}` |
//! | `Failed` | `-NAK {"delay": retry_delay}` |
//! | no id, [`MissingIdPolicy::Reject`] | `+TERM` |
//!
//! Identity: the `Nats-Msg-Id` header by default ([`IdSource`]), scoped by
//! the consumer name and the stream name. JetStream also drops a
//! re-published `Nats-Msg-Id` inside the stream's duplicate window; this
//! layer covers what that window does not: redeliveries after a missed ack
//! and re-publishes after the window.

use std::future::Future;
use std::time::Duration;

use async_nats::jetstream::consumer::PullConsumer;
use async_nats::jetstream::{AckKind, Message as JsMessage};
use futures::StreamExt;
use idem_core::BoxError;

use crate::{
    run_delivery, Disposition, IdError, IdSource, Incoming, Message, MissingIdPolicy, Processor,
    Report,
};

/// The header JetStream uses for a message's id.
pub const MSG_ID_HEADER: &str = "Nats-Msg-Id";

/// Settings of a [`NatsConsumer`].
#[derive(Debug, Clone)]
pub struct NatsOptions {
    /// The consumer name that scopes message ids. Default: the JetStream
    /// consumer's name as the server reports it on each message.
    pub consumer_name: Option<String>,
    /// Where the id comes from. Default [`IdSource::Broker`] (`Nats-Msg-Id`).
    pub id_source: IdSource,
    /// What to do with a message without id. Default [`MissingIdPolicy::Reject`].
    pub missing_id: MissingIdPolicy,
    /// Messages per pull request. Default 64.
    pub batch: usize,
    /// How long a pull request waits for its batch to fill. Default 1 s.
    pub wait: Duration,
    /// The `-NAK` delay after a failed handler, and the floor of the delay
    /// for an in-flight duplicate. Default 1 s.
    pub retry_delay: Duration,
}

impl Default for NatsOptions {
    fn default() -> Self {
        Self {
            consumer_name: None,
            id_source: IdSource::Broker,
            missing_id: MissingIdPolicy::Reject,
            batch: 64,
            wait: Duration::from_secs(1),
            retry_delay: Duration::from_secs(1),
        }
    }
}

/// A pull request to the server failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NatsError {
    /// Requesting or reading a batch failed.
    #[error("fetching a batch from JetStream failed")]
    Fetch(#[source] BoxError),
}

/// A deduplicating JetStream pull consumer: [`Processor`] + ack policy.
#[derive(Debug)]
pub struct NatsConsumer<P> {
    consumer: PullConsumer,
    processor: P,
    options: NatsOptions,
}

impl<P: Processor> NatsConsumer<P> {
    /// Consumes from `consumer` (a JetStream pull consumer with explicit
    /// acks) through `processor`.
    pub fn new(consumer: PullConsumer, processor: P, options: NatsOptions) -> Self {
        Self {
            consumer,
            processor,
            options,
        }
    }

    /// The processor.
    pub fn processor(&self) -> &P {
        &self.processor
    }

    /// Fetches one batch (up to [`NatsOptions::batch`] messages, waiting at
    /// most [`NatsOptions::wait`]) and handles each message.
    ///
    /// # Errors
    /// [`NatsError::Fetch`] when the pull request fails. Message-level
    /// failures are counted in the [`Report`], not returned.
    pub async fn run_batch(&self) -> Result<Report, NatsError> {
        let mut batch = self
            .consumer
            .batch()
            .max_messages(self.options.batch.max(1))
            .expires(self.options.wait)
            .messages()
            .await
            .map_err(|e| NatsError::Fetch(Box::new(e)))?;
        let mut report = Report::default();
        while let Some(item) = batch.next().await {
            let msg = item.map_err(NatsError::Fetch)?;
            report.merge(&self.handle(msg).await);
        }
        Ok(report)
    }

    /// Runs batches until `shutdown` completes (checked between messages'
    /// batches; a batch in progress finishes first).
    ///
    /// # Errors
    /// As [`Self::run_batch`].
    pub async fn run_until<F: Future<Output = ()>>(
        &self,
        shutdown: F,
    ) -> Result<Report, NatsError> {
        let mut total = Report::default();
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                biased;
                () = &mut shutdown => return Ok(total),
                r = self.run_batch() => total.merge(&r?),
            }
        }
    }

    /// Processes one delivered message and acks / naks / terminates it.
    pub async fn handle(&self, msg: JsMessage) -> Report {
        let message = message_of(&msg, &self.options);
        let msg = &msg;
        let settle = |disposition| async move {
            match disposition {
                Disposition::Ack => msg.ack().await,
                Disposition::Retry { delay } => msg.ack_with(AckKind::Nak(Some(delay))).await,
                Disposition::Reject => msg.ack_with(AckKind::Term).await,
            }
        };
        let notes = ("redelivered", "terminated");
        let delay = self.options.retry_delay;
        run_delivery(&self.processor, message, delay, notes, settle).await
    }
}

/// The [`Message`] of a JetStream delivery: id by `options.id_source`,
/// scoped by the consumer name and stream.
///
/// # Errors
/// [`IdError::Missing`] when there is no id and the policy is
/// [`MissingIdPolicy::Reject`] (or the delivery has no JetStream metadata).
pub fn message_of(msg: &JsMessage, options: &NatsOptions) -> Result<Message, IdError> {
    let info = msg
        .info()
        .map_err(|_| IdError::Missing("not a JetStream delivery"))?;
    let headers: Vec<(String, String)> = msg
        .headers
        .iter()
        .flat_map(|h| h.iter())
        .flat_map(|(k, vs)| {
            vs.iter()
                .map(move |v| (k.to_string(), v.as_str().to_owned()))
        })
        .collect();
    let broker_id = msg
        .headers
        .as_ref()
        .and_then(|h| {
            // The standard name, not a parsed string: async-nats keeps
            // `Nats-Msg-Id` as a standard header that a string key does not match.
            h.get(async_nats::header::NATS_MESSAGE_ID)
                .or_else(|| h.get(MSG_ID_HEADER))
        })
        .map(|v| v.as_str().to_owned());
    let incoming = Incoming {
        broker_id: broker_id.as_deref(),
        headers: &headers,
        payload: &msg.payload,
        stream: info.stream,
    };
    let consumer = options.consumer_name.as_deref().unwrap_or(info.consumer);
    let key = options.id_source.key_of(
        &incoming,
        consumer,
        options.missing_id,
        "no Nats-Msg-Id / extracted id",
    )?;
    Ok(Message {
        key,
        payload: msg.payload.to_vec(),
        delivery_attempt: u64::try_from(info.delivered).unwrap_or(1),
    })
}
