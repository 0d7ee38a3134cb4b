//! The SQL inbox as a [`Processor`]: exactly-once effect.

use async_trait::async_trait;
use idem_core::BoxError;
use idem_sql::inbox::{Claim, Inbox, InboxDatabase};
use sqlx::Transaction;

use crate::{Message, Outcome, Processor};

/// A handler whose writes share the inbox's transaction.
///
/// Do every business write on `tx` (`&mut **tx` as the executor): they
/// commit together with the inbox row, or not at all. An error rolls both
/// back and the message is redelivered. Effects outside the database (an
/// HTTP call) are not covered by the commit.
#[async_trait]
pub trait TxHandler<DB: InboxDatabase>: Send + Sync {
    /// Applies `msg`'s effect inside `tx`. Do not commit `tx` yourself.
    async fn handle(
        &self,
        tx: &mut Transaction<'static, DB>,
        msg: &Message,
    ) -> Result<(), BoxError>;
}

/// The exactly-once-effect [`Processor`]: [`Inbox::claim`] (inbox row
/// first), the handler on the same transaction, commit — and only then
/// does the adapter ack. **Use this one for money.**
///
/// The inbox's `consumer` column holds [`crate::MessageKey::scope_name`]
/// (consumer + stream + partition), `message_id` holds
/// [`crate::MessageKey::message_id`].
#[derive(Debug)]
pub struct SqlInbox<DB: InboxDatabase, H> {
    inbox: Inbox<DB>,
    handler: H,
}

impl<DB: InboxDatabase, H: TxHandler<DB>> SqlInbox<DB, H> {
    /// A processor over `inbox` (migrated) running `handler`.
    pub fn new(inbox: Inbox<DB>, handler: H) -> Self {
        Self { inbox, handler }
    }

    /// The inbox (for `purge_older_than`, `is_processed`).
    pub fn inbox(&self) -> &Inbox<DB> {
        &self.inbox
    }

    /// The handler.
    pub fn handler(&self) -> &H {
        &self.handler
    }
}

#[async_trait]
impl<DB: InboxDatabase, H: TxHandler<DB>> Processor for SqlInbox<DB, H> {
    async fn process(&self, msg: &Message) -> Outcome {
        let Some(key) = &msg.key else {
            // MissingIdPolicy::ProcessWithoutDedup: a plain transaction.
            let mut tx = match self.inbox.pool().begin().await {
                Ok(tx) => tx,
                Err(e) => return Outcome::Failed(Box::new(e)),
            };
            return match self.handler.handle(&mut tx, msg).await {
                Ok(()) => match tx.commit().await {
                    Ok(()) => Outcome::Applied,
                    Err(e) => Outcome::Failed(Box::new(e)),
                },
                Err(e) => Outcome::Failed(e),
            };
        };
        let claim = match self.inbox.claim(&key.scope_name(), &key.message_id()).await {
            Ok(c) => c,
            Err(e) => return Outcome::Failed(Box::new(e)),
        };
        match claim {
            Claim::Duplicate => Outcome::Duplicate,
            Claim::New(mut tx) => match self.handler.handle(&mut tx, msg).await {
                Ok(()) => match tx.commit().await {
                    Ok(()) => Outcome::Applied,
                    // Unknown outcome: no ack; the redelivery finds the row
                    // (committed) or applies the message (not committed).
                    Err(e) => Outcome::Failed(Box::new(e)),
                },
                Err(e) => {
                    if let Err(err) = tx.rollback().await {
                        tracing::warn!(error = %err, "idem-mq: rollback after a failed handler failed");
                    }
                    Outcome::Failed(e)
                }
            },
        }
    }
}

#[doc(hidden)]
pub mod __private {
    pub use async_trait::async_trait;
    pub use sqlx::Transaction;
}

/// Implements [`TxHandler`] for `$handler` on each listed database: one
/// body for all of them, with `$sql` bound to that database's statements
/// (any expression, e.g. a string or a tuple of strings in its placeholder
/// syntax). `$this` is `&self`, `$tx` the inbox's transaction, `$msg` the
/// message.
///
/// ```
/// use idem_mq::{tx_handler, BoxError};
///
/// struct Credit;
///
/// tx_handler!(Credit, |this, tx, msg, sql| {
///     let id = msg.key.as_ref().map(|k| k.raw_id().to_owned());
///     sqlx::query(sql).bind(id).execute(&mut **tx).await?;
///     Ok(())
/// }, sqlx::Sqlite => "INSERT INTO credits (id) VALUES (?1)");
/// ```
#[macro_export]
macro_rules! tx_handler {
    ($handler:ty, |$this:ident, $tx:ident, $msg:ident, $sql:ident| $body:block,
     $($db:ty => $stmts:expr),+ $(,)?) => {
        $(
            #[$crate::__private::async_trait]
            impl $crate::TxHandler<$db> for $handler {
                async fn handle(
                    &self,
                    $tx: &mut $crate::__private::Transaction<'static, $db>,
                    $msg: &$crate::Message,
                ) -> ::std::result::Result<(), $crate::BoxError> {
                    #[allow(unused_variables)]
                    let $this = self;
                    let $sql = $stmts;
                    $body
                }
            }
        )+
    };
}
