//! One connection type over a single node and a Cluster, and error mapping.

use std::future::Future;
use std::time::Duration;

use idem_core::{Phase, StoreError};
use redis::aio::{AsyncPushSender, ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClientBuilder;
use redis::cluster_async::ClusterConnection;
use redis::{
    Client, Cmd, ConnectionInfo, Pipeline, ProtocolVersion, RedisError, RedisFuture, RedisResult,
    Value,
};

use crate::target::Target;

/// A multiplexed connection that reconnects by itself: a
/// [`ConnectionManager`] for one node, a [`ClusterConnection`] (which follows
/// `MOVED`/`ASK` and topology changes) for a Cluster. Clones share the
/// connection.
#[derive(Clone)]
pub(crate) enum Conn {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

impl std::fmt::Debug for Conn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Single(_) => "Conn::Single",
            Self::Cluster(_) => "Conn::Cluster",
        })
    }
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Self::Single(c) => c.req_packed_command(cmd),
            Self::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Self::Single(c) => c.req_packed_commands(cmd, offset, count),
            Self::Cluster(c) => c.req_packed_commands(cmd, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Self::Single(c) => c.get_db(),
            Self::Cluster(c) => c.get_db(),
        }
    }
}

/// How a connection is opened.
#[derive(Clone, Debug)]
pub(crate) struct ConnectSettings {
    pub(crate) connection_timeout: Duration,
    pub(crate) response_timeout: Duration,
    /// A CA (PEM) for TLS connections instead of the system's roots.
    #[cfg(feature = "tls")]
    pub(crate) tls_root_cert_pem: Option<Vec<u8>>,
    /// A client certificate and key for mutual TLS.
    #[cfg(feature = "tls")]
    pub(crate) tls_client: Option<crate::TlsClientIdentity>,
}

impl ConnectSettings {
    pub(crate) fn new(options: &crate::RedisOptions) -> Self {
        Self {
            connection_timeout: options.connection_timeout,
            response_timeout: options.response_timeout,
            #[cfg(feature = "tls")]
            tls_root_cert_pem: options.tls_root_cert_pem.clone(),
            #[cfg(feature = "tls")]
            tls_client: options.tls_client.clone(),
        }
    }

    #[cfg(feature = "tls")]
    fn certs(&self) -> Option<redis::TlsCertificates> {
        // rustls needs one process-wide crypto provider; another crate may
        // have installed one already, which is fine.
        let _ = rustls::crypto::ring::default_provider().install_default();
        if self.tls_root_cert_pem.is_none() && self.tls_client.is_none() {
            return None;
        }
        Some(redis::TlsCertificates {
            client_tls: self.tls_client.as_ref().map(|id| redis::ClientTlsConfig {
                client_cert: id.cert_pem.clone(),
                client_key: id.key_pem.clone(),
            }),
            root_cert: self.tls_root_cert_pem.clone(),
        })
    }
}

/// Opens a connection to `target`. With `push`, the connection speaks RESP3
/// and hands pub/sub messages to it (re-subscribing after a reconnect).
pub(crate) async fn open(
    target: &Target,
    settings: &ConnectSettings,
    push: Option<impl AsyncPushSender>,
) -> RedisResult<Conn> {
    match target {
        Target::Single(info) => {
            let mut info = ConnectionInfo::clone(info);
            if push.is_some() {
                let redis = info
                    .redis_settings()
                    .clone()
                    .set_protocol(ProtocolVersion::RESP3);
                info = info.set_redis_settings(redis);
            }
            #[cfg(feature = "tls")]
            let client = match settings.certs() {
                Some(certs) => Client::build_with_tls(info, certs)?,
                None => Client::open(info)?,
            };
            #[cfg(not(feature = "tls"))]
            let client = Client::open(info)?;
            let mut config = ConnectionManagerConfig::new()
                .set_connection_timeout(Some(settings.connection_timeout))
                .set_response_timeout(Some(settings.response_timeout))
                // Reconnect attempts back off from 100 ms up to 2 s, and the
                // first connection gives up after a few tries: every step
                // is bounded by the store's own timeout anyway.
                .set_max_delay(Duration::from_secs(2))
                .set_number_of_retries(2);
            if let Some(push) = push {
                config = config.set_push_sender(push).set_automatic_resubscription();
            }
            Ok(Conn::Single(
                client.get_connection_manager_with_config(config).await?,
            ))
        }
        Target::Cluster(nodes) => {
            let mut builder = ClusterClientBuilder::new(nodes.clone())
                .connection_timeout(settings.connection_timeout)
                .response_timeout(settings.response_timeout)
                .retries(3);
            #[cfg(feature = "tls")]
            if let Some(certs) = settings.certs() {
                builder = builder.certs(certs);
            }
            if let Some(push) = push {
                builder = builder
                    .use_protocol(ProtocolVersion::RESP3)
                    .push_sender(push);
            }
            let client = builder.build()?;
            Ok(Conn::Cluster(client.get_async_connection().await?))
        }
    }
}

/// Maps a Redis error: a timeout inside the client is [`StoreError::Timeout`],
/// anything else (refused, reset, a server error) is
/// [`StoreError::Unavailable`] with the Redis error as its source.
pub(crate) fn store_error(phase: Phase, e: RedisError) -> StoreError {
    if e.is_timeout() {
        StoreError::Timeout { phase }
    } else {
        StoreError::unavailable(phase, e)
    }
}

/// Runs `fut` for at most `limit`: a late answer is [`StoreError::Timeout`]
/// (its effect unknown), a Redis error is mapped by [`store_error`].
pub(crate) async fn bounded<T>(
    phase: Phase,
    limit: Duration,
    fut: impl Future<Output = RedisResult<T>>,
) -> Result<T, StoreError> {
    match tokio::time::timeout(limit, fut).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(store_error(phase, e)),
        Err(_) => Err(StoreError::Timeout { phase }),
    }
}

/// A boxed no-op push sender type, for `open(…, None::<NoPush>)`.
pub(crate) type NoPush = fn(redis::PushInfo) -> Result<(), ()>;
