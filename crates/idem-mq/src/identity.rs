//! Message identity: which deliveries are "the same message".

use std::fmt;
use std::sync::Arc;

use idem_core::{Fingerprint, IdempotencyKey, Scope};

/// A message's identity for dedup: the consumer that processes it, the
/// stream/queue and partition it came from (where the broker has them),
/// and its id. Two keys are the same message only when all four match:
/// the same offset in two partitions, or the same id seen by two
/// consumers, are different messages.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct MessageKey {
    consumer: String,
    stream: Option<String>,
    partition: Option<String>,
    id: String,
}

/// A message key could not be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum IdError {
    /// The consumer name is empty.
    #[error("consumer name is empty")]
    EmptyConsumer,
    /// The message id is empty.
    #[error("message id is empty")]
    EmptyId,
    /// The message carries no id (no `Nats-Msg-Id` header / AMQP `message_id`
    /// property, or the extractor found none) and the policy is
    /// [`MissingIdPolicy::Reject`].
    #[error("message has no id ({0}); rejected (see MissingIdPolicy)")]
    Missing(&'static str),
}

fn escape(part: &str) -> String {
    part.replace('%', "%25").replace('/', "%2F")
}

impl MessageKey {
    /// A key for message `id` processed by `consumer`.
    ///
    /// Ids of any bytes and length are accepted; ids that are not 1–255
    /// visible ASCII characters are replaced by `sha256:<hex>` of the id.
    ///
    /// # Errors
    /// [`IdError::EmptyConsumer`], [`IdError::EmptyId`].
    pub fn new(consumer: impl Into<String>, id: impl Into<String>) -> Result<Self, IdError> {
        let (consumer, id) = (consumer.into(), id.into());
        if consumer.is_empty() {
            return Err(IdError::EmptyConsumer);
        }
        if id.is_empty() {
            return Err(IdError::EmptyId);
        }
        Ok(Self {
            consumer,
            stream: None,
            partition: None,
            id,
        })
    }

    /// Scopes the key by a stream (NATS) or queue (RabbitMQ) name.
    pub fn with_stream(mut self, stream: impl Into<String>) -> Self {
        self.stream = Some(stream.into()).filter(|s| !s.is_empty());
        self
    }

    /// Scopes the key by a partition (a Kafka-style partition number, a
    /// RabbitMQ super-stream partition): the same offset in two partitions
    /// is two messages.
    pub fn with_partition(mut self, partition: impl Into<String>) -> Self {
        self.partition = Some(partition.into()).filter(|s| !s.is_empty());
        self
    }

    /// The consumer name.
    pub fn consumer(&self) -> &str {
        &self.consumer
    }

    /// The stream or queue, if any.
    pub fn stream(&self) -> Option<&str> {
        self.stream.as_deref()
    }

    /// The partition, if any.
    pub fn partition(&self) -> Option<&str> {
        self.partition.as_deref()
    }

    /// The id as the broker (or extractor) gave it.
    pub fn raw_id(&self) -> &str {
        &self.id
    }

    /// The dedup scope as a string: `consumer[/s=stream][/p=partition]`,
    /// with `%` and `/` inside each part escaped as `%25` and `%2F` (so no
    /// two different keys share it); `sha256:<hex>` of that when it is
    /// longer than 255 bytes. Used as the inbox's `consumer` column and
    /// the store's [`Scope`].
    pub fn scope_name(&self) -> String {
        let mut s = escape(&self.consumer);
        if let Some(stream) = &self.stream {
            s.push_str("/s=");
            s.push_str(&escape(stream));
        }
        if let Some(p) = &self.partition {
            s.push_str("/p=");
            s.push_str(&escape(p));
        }
        if s.len() > idem_core::MAX_KEY_LEN {
            s = format!("sha256:{}", Fingerprint::of(s.as_bytes()).to_hex());
        }
        s
    }

    /// The id as stored: the raw id when it is 1–255 visible ASCII
    /// characters, else `sha256:<hex>` of it.
    pub fn message_id(&self) -> String {
        self.idempotency_key().as_str().to_owned()
    }

    /// The store scope (see [`Self::scope_name`]).
    pub fn scope(&self) -> Scope {
        crate::scope_of(self.scope_name())
    }

    /// The store key (see [`Self::message_id`]).
    pub fn idempotency_key(&self) -> IdempotencyKey {
        crate::key_of(&self.id)
    }
}

impl fmt::Debug for MessageKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "MessageKey({}#{})", self.scope_name(), self.id)
    }
}

/// What an [`IdExtractor`] sees of a delivery, whatever the broker.
#[derive(Debug, Clone, Copy)]
pub struct Incoming<'a> {
    /// The broker's own id: the `Nats-Msg-Id` header, the AMQP `message_id` property.
    pub broker_id: Option<&'a str>,
    /// The headers with text values (NATS headers; AMQP string headers).
    pub headers: &'a [(String, String)],
    /// The payload.
    pub payload: &'a [u8],
    /// The stream (NATS) or queue (RabbitMQ) it came from.
    pub stream: &'a str,
}

impl Incoming<'_> {
    /// The first header named `name` (ASCII case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// A user function that finds a message's id (and optionally partition).
/// Returns `None` when the message has none.
pub type IdExtractor = Arc<dyn Fn(&Incoming<'_>) -> Option<String> + Send + Sync>;

/// Where a message's id comes from.
#[derive(Clone, Default)]
pub enum IdSource {
    /// The broker's id: `Nats-Msg-Id` header (NATS), `message_id` property
    /// (AMQP). The default.
    #[default]
    Broker,
    /// A header with this name (ASCII case-insensitive).
    Header(String),
    /// A function of the delivery (e.g. a field of the JSON payload).
    Extractor(IdExtractor),
}

impl fmt::Debug for IdSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            IdSource::Broker => f.write_str("Broker"),
            IdSource::Header(h) => f.debug_tuple("Header").field(h).finish(),
            IdSource::Extractor(_) => f.write_str("Extractor(..)"),
        }
    }
}

impl IdSource {
    /// The id of `msg`, or `None`. Empty ids count as none.
    pub fn extract(&self, msg: &Incoming<'_>) -> Option<String> {
        let id = match self {
            IdSource::Broker => msg.broker_id.map(str::to_owned),
            IdSource::Header(name) => msg.header(name).map(str::to_owned),
            IdSource::Extractor(f) => f(msg),
        };
        id.filter(|s| !s.is_empty())
    }

    /// The key of `msg` for `consumer`, scoped by its stream; without an
    /// id, what `missing` says: `None` (process without dedup) or
    /// [`IdError::Missing`]`(what)`.
    #[cfg(any(feature = "amqp", feature = "nats"))]
    pub(crate) fn key_of(
        &self,
        msg: &Incoming<'_>,
        consumer: impl Into<String>,
        missing: MissingIdPolicy,
        what: &'static str,
    ) -> Result<Option<MessageKey>, IdError> {
        match self.extract(msg) {
            Some(id) => Ok(Some(MessageKey::new(consumer, id)?.with_stream(msg.stream))),
            None => match missing {
                MissingIdPolicy::ProcessWithoutDedup => Ok(None),
                _ => Err(IdError::Missing(what)),
            },
        }
    }
}

/// What to do with a message that has no id.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum MissingIdPolicy {
    /// Refuse it without requeue (NATS `+TERM`; RabbitMQ `basic.reject
    /// requeue=false`, dead-lettered where the queue has a dead-letter
    /// exchange). The default: an id-less message cannot be deduplicated.
    #[default]
    Reject,
    /// Run the handler with no dedup (`Message::key` is `None`): a
    /// redelivery of it runs again. Only for handlers that are idempotent
    /// by themselves.
    ProcessWithoutDedup,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scope_parts_cannot_collide() {
        let a = MessageKey::new("c/s=x", "1").unwrap();
        let b = MessageKey::new("c", "1").unwrap().with_stream("x");
        assert_ne!(a.scope_name(), b.scope_name());
        let in_partition = |p| {
            MessageKey::new("c", "7")
                .unwrap()
                .with_stream("s")
                .with_partition(p)
        };
        let (p0, p1) = (in_partition("0"), in_partition("1"));
        assert_ne!(p0.scope_name(), p1.scope_name());
        assert_eq!(p0.scope_name(), "c/s=s/p=0");
    }

    #[test]
    fn odd_ids_are_hashed_not_refused() {
        let k = MessageKey::new("c", "é\n".repeat(200)).unwrap();
        assert!(k.message_id().starts_with("sha256:"));
        assert_eq!(k.message_id().len(), 71);
        let long = MessageKey::new("c".repeat(300), "1").unwrap();
        assert!(long.scope_name().starts_with("sha256:"));
        assert_eq!(MessageKey::new("", "1"), Err(IdError::EmptyConsumer));
        assert_eq!(MessageKey::new("c", ""), Err(IdError::EmptyId));
    }

    #[test]
    fn id_sources() {
        let headers = vec![("X-Id".to_owned(), "h1".to_owned())];
        let m = Incoming {
            broker_id: Some("b1"),
            headers: &headers,
            payload: b"{}",
            stream: "S",
        };
        assert_eq!(IdSource::Broker.extract(&m).as_deref(), Some("b1"));
        assert_eq!(
            IdSource::Header("x-id".into()).extract(&m).as_deref(),
            Some("h1")
        );
        let f: IdExtractor = Arc::new(|m: &Incoming<'_>| Some(format!("{}-p", m.stream)));
        assert_eq!(IdSource::Extractor(f).extract(&m).as_deref(), Some("S-p"));
        let none = Incoming {
            broker_id: Some(""),
            ..m
        };
        assert_eq!(IdSource::Broker.extract(&none), None);
    }
}
