//! RabbitMQ consumers with manual acks (feature `amqp`, crate `lapin`,
//! plain `amqp://`).
//!
//! The consumer uses `basic.consume` with `no_ack = false` and a prefetch
//! of [`AmqpOptions::prefetch`]; each delivery is processed and settled on
//! its own:
//!
//! | [`Outcome`] | AMQP |
//! |---|---|
//! | `Applied`, `Duplicate` | `basic.ack` (after the inbox commit) |
//! | `InFlight` | `basic.nack requeue=true`, sent after the holder's lease left |
//! | `Failed` | `basic.nack requeue=true`, sent after [`AmqpOptions::retry_delay`] |
//! | no id, [`MissingIdPolicy::Reject`] | `basic.reject requeue=false` (dead-lettered where the queue has a DLX) |
//!
//! RabbitMQ has no delayed nack: the adapter holds the delivery (it counts
//! against the prefetch) for the delay in a background task, then nacks it,
//! so a failing message does not spin and the others keep flowing.
//!
//! Identity: the AMQP `message_id` property by default ([`IdSource`]),
//! scoped by the consumer name and the queue name.

use std::future::Future;
use std::time::Duration;

use futures::StreamExt;
use lapin::message::Delivery;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions, BasicRejectOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::Channel;

use crate::{
    run_delivery, Disposition, IdError, IdSource, Incoming, Message, MissingIdPolicy, Processor,
    Report,
};

/// Settings of an [`AmqpConsumer`].
#[derive(Debug, Clone)]
pub struct AmqpOptions {
    /// The consumer name that scopes message ids (also the consumer tag's prefix).
    pub consumer_name: String,
    /// Where the id comes from. Default [`IdSource::Broker`] (`message_id`).
    pub id_source: IdSource,
    /// What to do with a message without id. Default [`MissingIdPolicy::Reject`].
    pub missing_id: MissingIdPolicy,
    /// `basic.qos` prefetch count: unacked deliveries in flight. Default 64.
    pub prefetch: u16,
    /// Delay before a failed message is requeued, and the floor of the delay
    /// for an in-flight duplicate. Default 1 s.
    pub retry_delay: Duration,
}

impl AmqpOptions {
    /// Defaults with this consumer name.
    pub fn new(consumer_name: impl Into<String>) -> Self {
        Self {
            consumer_name: consumer_name.into(),
            id_source: IdSource::Broker,
            missing_id: MissingIdPolicy::Reject,
            prefetch: 64,
            retry_delay: Duration::from_secs(1),
        }
    }
}

/// The channel failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AmqpError {
    /// `basic.qos`, `basic.consume` or a delivery failed.
    #[error("RabbitMQ consumer failed")]
    Channel(#[source] lapin::Error),
}

/// A deduplicating RabbitMQ consumer: [`Processor`] + ack policy.
#[derive(Debug)]
pub struct AmqpConsumer<P> {
    channel: Channel,
    queue: String,
    processor: P,
    options: AmqpOptions,
}

impl<P: Processor> AmqpConsumer<P> {
    /// Consumes `queue` on `channel` through `processor`.
    pub fn new(
        channel: Channel,
        queue: impl Into<String>,
        processor: P,
        options: AmqpOptions,
    ) -> Self {
        Self {
            channel,
            queue: queue.into(),
            processor,
            options,
        }
    }

    /// The processor.
    pub fn processor(&self) -> &P {
        &self.processor
    }

    /// Consumes until `shutdown` completes (checked between deliveries), or
    /// the channel closes. Unsettled deliveries go back to the queue when
    /// the channel closes.
    ///
    /// # Errors
    /// [`AmqpError::Channel`].
    pub async fn run_until<F: Future<Output = ()>>(
        &self,
        shutdown: F,
    ) -> Result<Report, AmqpError> {
        self.channel
            .basic_qos(self.options.prefetch, BasicQosOptions::default())
            .await
            .map_err(AmqpError::Channel)?;
        let tag = format!("{}-{}", self.options.consumer_name, rand_suffix());
        let mut consumer = self
            .channel
            .basic_consume(
                &self.queue,
                &tag,
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(AmqpError::Channel)?;
        let mut total = Report::default();
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                biased;
                () = &mut shutdown => break,
                next = consumer.next() => match next {
                    Some(Ok(delivery)) => total.merge(&self.handle(delivery).await),
                    Some(Err(e)) => return Err(AmqpError::Channel(e)),
                    None => break,
                },
            }
        }
        // Stop deliveries to this consumer; the unacked rest is requeued when the channel closes.
        let _ = self
            .channel
            .basic_cancel(&tag, lapin::options::BasicCancelOptions::default())
            .await;
        Ok(total)
    }

    /// Processes one delivery and settles it (ack now; nack after the
    /// retry delay in a background task; reject).
    pub async fn handle(&self, delivery: Delivery) -> Report {
        let message = message_of(&delivery, &self.queue, &self.options);
        let acker = delivery.acker;
        let settle = |disposition| async move {
            match disposition {
                Disposition::Ack => acker.ack(BasicAckOptions::default()).await,
                Disposition::Reject => acker.reject(BasicRejectOptions { requeue: false }).await,
                Disposition::Retry { delay } => {
                    tokio::spawn(async move {
                        tokio::time::sleep(delay).await;
                        let nack = BasicNackOptions {
                            multiple: false,
                            requeue: true,
                        };
                        if let Err(e) = acker.nack(nack).await {
                            // The channel is gone: the broker requeues it anyway.
                            tracing::warn!(error = %e, "idem-mq: nack failed");
                        }
                    });
                    Ok(())
                }
            }
        };
        let notes = ("requeued", "rejected");
        let delay = self.options.retry_delay;
        run_delivery(&self.processor, message, delay, notes, settle).await
    }
}

fn rand_suffix() -> String {
    use std::time::{SystemTime, UNIX_EPOCH};
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!("{}-{nanos:08x}", std::process::id())
}

fn text_of(v: &AMQPValue) -> Option<String> {
    match v {
        AMQPValue::ShortString(s) => Some(s.as_str().to_owned()),
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        _ => None,
    }
}

/// The [`Message`] of a delivery from `queue`: id by `options.id_source`,
/// scoped by the consumer name and the queue.
///
/// # Errors
/// [`IdError::Missing`] when there is no id and the policy is
/// [`MissingIdPolicy::Reject`]; [`IdError::EmptyConsumer`].
pub fn message_of(
    delivery: &Delivery,
    queue: &str,
    options: &AmqpOptions,
) -> Result<Message, IdError> {
    let headers: Vec<(String, String)> = delivery
        .properties
        .headers()
        .iter()
        .flat_map(|t| t.inner().iter())
        .filter_map(|(k, v)| text_of(v).map(|v| (k.as_str().to_owned(), v)))
        .collect();
    let broker_id = delivery
        .properties
        .message_id()
        .as_ref()
        .map(|s| s.as_str());
    let incoming = Incoming {
        broker_id,
        headers: &headers,
        payload: &delivery.data,
        stream: queue,
    };
    let key = options.id_source.key_of(
        &incoming,
        options.consumer_name.clone(),
        options.missing_id,
        "no message_id property / extracted id",
    )?;
    Ok(Message {
        key,
        payload: delivery.data.clone(),
        delivery_attempt: if delivery.redelivered { 2 } else { 1 },
    })
}
