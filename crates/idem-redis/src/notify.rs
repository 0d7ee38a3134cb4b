//! Change notifications over Redis pub/sub, fanned out to waiters.
//!
//! One subscriber connection per store (RESP3, opened on the first wait)
//! carries the `SUBSCRIBE`s of every channel somebody waits on; a push
//! handler wakes the waiters of the channel a message came on. Channels are
//! subscribed while at least one waiter waits on them and unsubscribed when
//! the last one leaves. A dropped subscriber connection wakes every waiter
//! (they re-read the record; spurious wake-ups are allowed), and the
//! connection re-subscribes by itself once it is back.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use redis::{PushInfo, PushKind, Value};
use tokio::sync::{Notify, OnceCell};

use crate::conn::{self, Conn, ConnectSettings};
use crate::target::Target;

/// After the subscriber connection failed to open, waits poll instead of
/// trying again for this long.
const RETRY_SUBSCRIBER_AFTER: Duration = Duration::from_secs(5);

#[derive(Debug)]
struct Route {
    notify: Arc<Notify>,
    waiters: usize,
}

type Routes = Mutex<HashMap<Vec<u8>, Route>>;

fn lock(routes: &Routes) -> MutexGuard<'_, HashMap<Vec<u8>, Route>> {
    // The map stays consistent under a panic: every change is one insert or remove.
    routes.lock().unwrap_or_else(|p| p.into_inner())
}

/// The shared subscriber and its waiters.
pub(crate) struct Notifier {
    routes: Arc<Routes>,
    /// Serialises SUBSCRIBE / UNSUBSCRIBE, so they reach the server in the
    /// order their decisions were taken.
    order: tokio::sync::Mutex<()>,
    conn: OnceCell<Conn>,
    failed_at: Mutex<Option<Instant>>,
    target: Target,
    settings: ConnectSettings,
}

impl std::fmt::Debug for Notifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Notifier")
            .field("channels", &lock(&self.routes).len())
            .field("connected", &self.conn.initialized())
            .finish()
    }
}

/// One waiter's interest in one channel; leaving (on drop) unsubscribes the
/// channel when it was the last waiter.
pub(crate) struct Registration {
    notifier: Arc<Notifier>,
    channel: Vec<u8>,
    notify: Arc<Notify>,
}

impl Registration {
    /// The [`Notify`] woken by a message on the channel (or a lost subscriber
    /// connection). Create and `enable` its `notified()` future before
    /// [`Notifier::subscribe`], so no message slips between the two.
    pub(crate) fn notify(&self) -> &Notify {
        &self.notify
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        let last = {
            let mut routes = lock(&self.notifier.routes);
            match routes.get_mut(&self.channel) {
                Some(r) if r.waiters > 1 => {
                    r.waiters -= 1;
                    false
                }
                Some(_) => {
                    routes.remove(&self.channel);
                    true
                }
                None => false,
            }
        };
        if last && self.notifier.conn.initialized() {
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                let notifier = self.notifier.clone();
                let channel = std::mem::take(&mut self.channel);
                rt.spawn(async move { notifier.unsubscribe_if_unused(channel).await });
            }
        }
    }
}

impl Notifier {
    pub(crate) fn new(target: Target, settings: ConnectSettings) -> Self {
        Self {
            routes: Arc::new(Mutex::new(HashMap::new())),
            order: tokio::sync::Mutex::new(()),
            conn: OnceCell::new(),
            failed_at: Mutex::new(None),
            target,
            settings,
        }
    }

    /// Registers a waiter on `channel` (no I/O).
    pub(crate) fn join(self: &Arc<Self>, channel: &str) -> Registration {
        let channel = channel.as_bytes().to_vec();
        let notify = {
            let mut routes = lock(&self.routes);
            let r = routes.entry(channel.clone()).or_insert_with(|| Route {
                notify: Arc::new(Notify::new()),
                waiters: 0,
            });
            r.waiters += 1;
            r.notify.clone()
        };
        Registration {
            notifier: self.clone(),
            channel,
            notify,
        }
    }

    /// Makes sure the subscriber connection listens on the registration's
    /// channel, within `limit`. Returns whether it does; `false` means the
    /// caller must poll.
    pub(crate) async fn subscribe(&self, reg: &Registration, limit: Duration) -> bool {
        let fut = async {
            let mut conn = self.subscriber(limit).await?;
            let _order = self.order.lock().await;
            let done = match &mut conn {
                Conn::Single(c) => c.subscribe(&reg.channel[..]).await,
                Conn::Cluster(c) => c.subscribe(&reg.channel[..]).await,
            };
            match done {
                Ok(()) => Some(()),
                Err(e) => {
                    tracing::debug!(error = %e, "SUBSCRIBE failed; waiting by polling");
                    None
                }
            }
        };
        matches!(tokio::time::timeout(limit, fut).await, Ok(Some(())))
    }

    /// The subscriber connection, opened on first use.
    async fn subscriber(&self, limit: Duration) -> Option<Conn> {
        if let Some(c) = self.conn.get() {
            return Some(c.clone());
        }
        {
            let failed = self.failed_at.lock().unwrap_or_else(|p| p.into_inner());
            if failed.is_some_and(|at| at.elapsed() < RETRY_SUBSCRIBER_AFTER) {
                return None;
            }
        }
        let push = push_handler(Arc::downgrade(&self.routes));
        let settings = ConnectSettings {
            connection_timeout: self.settings.connection_timeout.min(limit),
            ..self.settings.clone()
        };
        let opened = self
            .conn
            .get_or_try_init(|| async {
                match tokio::time::timeout(limit, conn::open(&self.target, &settings, Some(push)))
                    .await
                {
                    Ok(Ok(c)) => Ok(c),
                    Ok(Err(e)) => Err(e.to_string()),
                    Err(_) => Err("timed out".to_owned()),
                }
            })
            .await;
        match opened {
            Ok(c) => Some(c.clone()),
            Err(e) => {
                tracing::debug!(error = %e, "cannot open the pub/sub connection; waiting by polling");
                *self.failed_at.lock().unwrap_or_else(|p| p.into_inner()) = Some(Instant::now());
                None
            }
        }
    }

    async fn unsubscribe_if_unused(&self, channel: Vec<u8>) {
        let Some(conn) = self.conn.get() else {
            return;
        };
        let mut conn = conn.clone();
        let _order = self.order.lock().await;
        if lock(&self.routes).contains_key(&channel) {
            return; // a new waiter came; it subscribes (again) itself
        }
        let undo = async {
            match &mut conn {
                Conn::Single(c) => c.unsubscribe(&channel[..]).await,
                Conn::Cluster(c) => c.unsubscribe(&channel[..]).await,
            }
        };
        if let Ok(Err(e)) = tokio::time::timeout(self.settings.response_timeout, undo).await {
            tracing::debug!(error = %e, "UNSUBSCRIBE failed");
        }
    }
}

/// The push handler: wakes the waiters of a message's channel, or every
/// waiter when the connection dropped. Never blocks.
fn push_handler(
    routes: Weak<Routes>,
) -> impl Fn(PushInfo) -> Result<(), ()> + Send + Sync + 'static {
    move |info: PushInfo| {
        let Some(routes) = routes.upgrade() else {
            return Err(());
        };
        let routes = lock(&routes);
        match info.kind {
            PushKind::Message | PushKind::SMessage => {
                if let Some(Value::BulkString(channel)) = info.data.first() {
                    if let Some(r) = routes.get(channel) {
                        r.notify.notify_waiters();
                    }
                }
            }
            PushKind::Disconnection => {
                for r in routes.values() {
                    r.notify.notify_waiters();
                }
            }
            _ => {}
        }
        Ok(())
    }
}
