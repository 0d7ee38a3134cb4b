//! Settings of a [`RedisStore`](crate::RedisStore).

use std::time::Duration;

use idem_core::StoreError;

/// The longest key prefix accepted, in bytes.
pub const MAX_PREFIX_LEN: usize = 64;

/// Settings of a [`RedisStore`](crate::RedisStore) opened with
/// [`RedisStore::connect_with`](crate::RedisStore::connect_with).
///
/// ```
/// use std::time::Duration;
/// use idem_redis::RedisOptions;
/// let opts = RedisOptions::default()
///     .with_key_prefix("payments")
///     .with_response_timeout(Duration::from_millis(500));
/// assert_eq!(opts.key_prefix, "payments");
/// assert_eq!(opts.connection_timeout, Duration::from_secs(2));
/// ```
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct RedisOptions {
    /// The first part of every key and channel name the store uses
    /// (default `idem`): `{<prefix>:<64 hex>}:r`. 1 to 64 bytes of visible
    /// ASCII without `{`, `}`, `*`, `?`, `[`, `]` or `\` (they would break the
    /// Cluster hash tag or the `SCAN` pattern). Two deployments sharing one
    /// Redis keep apart with different prefixes.
    pub key_prefix: String,
    /// How long one step (one script call, including a resend as `EVAL`
    /// after `NOSCRIPT` and waiting for a reconnect) may take before it fails with
    /// [`StoreError::Timeout`] (default 2 s). After a timeout the step's
    /// effect is unknown.
    pub response_timeout: Duration,
    /// How long opening a connection may take before it fails (default 2 s):
    /// [`StoreError::Unavailable`] from
    /// [`RedisStore::connect`](crate::RedisStore::connect).
    pub connection_timeout: Duration,
    /// How long Redis keeps a record after its lease or TTL has ended before
    /// dropping it by itself (default 1 h; at most 100 years).
    ///
    /// A record past its end already reads as absent to `begin` and `get`;
    /// keeping it a while longer lets the holder of a lease that ran out
    /// (but was not taken over) still `complete` it, exactly as the SQL
    /// stores allow until their next purge, and lets
    /// [`Store::purge_expired`](idem_core::Store::purge_expired) find and
    /// count it. The per-key fence counter is kept this long again after the
    /// record. Memory: ended records linger for up to this long unless
    /// purged.
    pub keep_expired: Duration,
    /// How often [`Store::wait_for_change`](idem_core::Store::wait_for_change)
    /// re-reads the record when pub/sub is not available (default 50 ms, at
    /// least 1 ms). With pub/sub working it re-reads once a second as a safety
    /// net.
    pub poll_interval: Duration,
    /// How many keys one `SCAN` step asks each node for during
    /// [`Store::purge_expired`](idem_core::Store::purge_expired)
    /// (`COUNT`, default 500, at least 1).
    pub scan_count: usize,
    /// For `rediss://` URLs: the CA certificate(s), PEM, that the server's
    /// certificate must chain to (default `None`: the system's root
    /// certificates). Feature `tls`.
    #[cfg(feature = "tls")]
    pub tls_root_cert_pem: Option<Vec<u8>>,
    /// For `rediss://` URLs: the certificate and key this client shows when
    /// the server asks for one (mutual TLS; default `None`). Feature `tls`.
    #[cfg(feature = "tls")]
    pub tls_client: Option<TlsClientIdentity>,
}

/// A client certificate (chain) and its private key, both PEM, for Redis
/// servers that check clients (`tls-auth-clients yes`). Its `Debug` hides
/// the key. Feature `tls`.
#[cfg(feature = "tls")]
#[derive(Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct TlsClientIdentity {
    /// The client's certificate, then any intermediates, PEM.
    pub cert_pem: Vec<u8>,
    /// Its private key, PEM (PKCS#8, PKCS#1 or SEC1).
    pub key_pem: Vec<u8>,
}

#[cfg(feature = "tls")]
impl TlsClientIdentity {
    /// A certificate (chain) and its key, PEM.
    pub fn new(cert_pem: impl Into<Vec<u8>>, key_pem: impl Into<Vec<u8>>) -> Self {
        Self {
            cert_pem: cert_pem.into(),
            key_pem: key_pem.into(),
        }
    }
}

#[cfg(feature = "tls")]
impl std::fmt::Debug for TlsClientIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsClientIdentity")
            .field("cert_pem", &format_args!("{} bytes", self.cert_pem.len()))
            .field("key_pem", &"***")
            .finish()
    }
}

impl Default for RedisOptions {
    fn default() -> Self {
        Self {
            key_prefix: "idem".to_owned(),
            response_timeout: Duration::from_secs(2),
            connection_timeout: Duration::from_secs(2),
            keep_expired: Duration::from_secs(3600),
            poll_interval: Duration::from_millis(50),
            scan_count: 500,
            #[cfg(feature = "tls")]
            tls_root_cert_pem: None,
            #[cfg(feature = "tls")]
            tls_client: None,
        }
    }
}

impl RedisOptions {
    /// Sets [`Self::key_prefix`] (checked when the store connects).
    pub fn with_key_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.key_prefix = prefix.into();
        self
    }

    /// Sets [`Self::response_timeout`].
    pub fn with_response_timeout(mut self, d: Duration) -> Self {
        self.response_timeout = d;
        self
    }

    /// Sets [`Self::connection_timeout`].
    pub fn with_connection_timeout(mut self, d: Duration) -> Self {
        self.connection_timeout = d;
        self
    }

    /// Sets [`Self::keep_expired`].
    pub fn with_keep_expired(mut self, d: Duration) -> Self {
        self.keep_expired = d;
        self
    }

    /// Sets [`Self::poll_interval`] (at least 1 ms).
    pub fn with_poll_interval(mut self, d: Duration) -> Self {
        self.poll_interval = d.max(Duration::from_millis(1));
        self
    }

    /// Sets [`Self::scan_count`] (0 is taken as 1).
    pub fn with_scan_count(mut self, n: usize) -> Self {
        self.scan_count = n.max(1);
        self
    }

    /// Sets [`Self::tls_root_cert_pem`]: trust servers whose certificate
    /// chains to this CA (PEM). Feature `tls`.
    #[cfg(feature = "tls")]
    pub fn with_tls_root_cert_pem(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.tls_root_cert_pem = Some(pem.into());
        self
    }

    /// Sets [`Self::tls_client`]: the certificate and key shown to a server
    /// that asks for one. Feature `tls`.
    #[cfg(feature = "tls")]
    pub fn with_tls_client(mut self, identity: TlsClientIdentity) -> Self {
        self.tls_client = Some(identity);
        self
    }

    /// Checks the settings.
    ///
    /// # Errors
    /// [`StoreError::Config`] for a key prefix that is empty, longer than
    /// [`MAX_PREFIX_LEN`], or holds a character outside visible ASCII or one
    /// of `{}*?[]\`; for a zero response or connection timeout.
    pub fn validate(&self) -> Result<(), StoreError> {
        let p = &self.key_prefix;
        if p.is_empty() || p.len() > MAX_PREFIX_LEN {
            return Err(StoreError::Config(format!(
                "Redis key prefix {p:?} must be 1 to {MAX_PREFIX_LEN} bytes long"
            )));
        }
        if let Some(c) = p
            .chars()
            .find(|c| !c.is_ascii_graphic() || "{}*?[]\\".contains(*c))
        {
            return Err(StoreError::Config(format!(
                "Redis key prefix {p:?} holds {c:?}; use visible ASCII without {{}}*?[]\\"
            )));
        }
        if self.response_timeout.is_zero() || self.connection_timeout.is_zero() {
            return Err(StoreError::Config(
                "Redis response and connection timeouts must be positive".into(),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_is_valid() {
        RedisOptions::default().validate().expect("valid");
        RedisOptions::default()
            .with_key_prefix("app:idem-v2_x.y")
            .validate()
            .expect("valid");
    }

    #[test]
    fn rejects_prefixes_that_break_tags_or_patterns() {
        for bad in [
            "",
            "a{b",
            "a}b",
            "a*",
            "a?",
            "a[",
            "a]",
            "a\\b",
            "a b",
            "é",
            &"x".repeat(65),
        ] {
            assert!(
                matches!(
                    RedisOptions::default().with_key_prefix(bad).validate(),
                    Err(StoreError::Config(_))
                ),
                "{bad:?} must be refused"
            );
        }
        assert!(RedisOptions::default()
            .with_response_timeout(Duration::ZERO)
            .validate()
            .is_err());
    }
}
