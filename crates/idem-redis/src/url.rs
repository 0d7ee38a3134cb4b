//! Reading a Redis store URL: its `idem_prefix` parameter and the URL left
//! for the driver (see [`idem_core::url`] for the rules every store shares).

use idem_core::url::{Param, StoreUrl};
use idem_core::{RedactedUrl, StoreError};

use crate::RedisOptions;

/// The `idem_*` parameters of a Redis store URL.
const PARAMS: &[Param] = &[
    Param::Text("idem_prefix"),
    Param::Text("idem_tls_ca"),
    Param::Text("idem_tls_cert"),
    Param::Text("idem_tls_key"),
];

/// A checked Redis store URL: `redis://[user:password@]host[:port][/db]`,
/// `rediss://…` (TLS), `redis+unix:///path.sock`, or
/// `redis+cluster://host:port,host:port` (`rediss+cluster://`), with the
/// options its `idem_*` parameters set:
///
/// | parameter | meaning |
/// |---|---|
/// | `idem_prefix` | [`RedisOptions::key_prefix`] |
/// | `idem_tls_ca=/path/ca.pem` | `rediss` only: the CA certificate(s), PEM, the server's certificate must chain to, instead of the system's roots (`RedisOptions::tls_root_cert_pem`) |
/// | `idem_tls_cert=/path/client.crt`, `idem_tls_key=/path/client.key` | `rediss` only, both or neither: the client certificate (chain) and key, PEM, for servers that check clients (`RedisOptions::tls_client`) |
///
/// The files are read here, so a missing or malformed one is a
/// configuration error before anything connects. The server's certificate
/// is always checked against the host name in the URL: redis-rs's
/// `#insecure` fragment (no certificate check at all) is refused, as is
/// any other fragment.
///
/// ```
/// use idem_redis::RedisUrl;
/// let u = RedisUrl::parse("redis://:pw@h:6379/2?protocol=resp3&idem_prefix=pay%3Av2")?;
/// assert_eq!(u.url.expose(), "redis://:pw@h:6379/2?protocol=resp3");
/// assert_eq!(u.url.to_string(), "redis://:***@h:6379/2?protocol=resp3");
/// assert_eq!(u.options.key_prefix, "pay:v2");
/// assert!(!u.cluster);
/// # Ok::<(), idem_core::StoreError>(())
/// ```
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct RedisUrl {
    /// The URL for [`RedisStore::connect_with`](crate::RedisStore::connect_with):
    /// the scheme in lower case, the `idem_*` parameters removed.
    pub url: RedactedUrl,
    /// [`RedisOptions::default`] with [`RedisOptions::key_prefix`] from
    /// `idem_prefix` when given (checked by [`RedisOptions::validate`]).
    pub options: RedisOptions,
    /// The URL names a Redis Cluster (`redis+cluster://`,
    /// `rediss+cluster://`).
    pub cluster: bool,
}

impl RedisUrl {
    /// Reads a Redis store URL, and the TLS files it names, without
    /// connecting.
    ///
    /// # Errors
    /// [`StoreError::Config`] for a scheme that is not a Redis one, a URL
    /// that names no server, a `#` fragment (`#insecure`), an unknown
    /// `idem_*` parameter, an empty, repeated or malformed one, a prefix
    /// that [`RedisOptions::validate`] refuses, an `idem_tls_*` parameter on
    /// a URL without TLS (or in a build without the `tls` feature),
    /// `idem_tls_cert` without `idem_tls_key` or the other way round, or a
    /// TLS file that cannot be read or holds no certificate (no key).
    pub fn parse(url: &str) -> Result<Self, StoreError> {
        let u = StoreUrl::parse(url)?;
        if url.contains('#') {
            return Err(u.error(
                "a Redis store URL takes no #fragment; #insecure (no certificate check) is \
                 refused: trust a private CA with ?idem_tls_ca=/path/ca.pem instead",
            ));
        }
        let (cluster, kind) = match u.scheme() {
            "redis" | "rediss" | "redis+unix" => (false, "redis"),
            "redis+cluster" | "rediss+cluster" => (true, "redis-cluster"),
            _ => {
                return Err(u.error(
                    "not a Redis URL; use redis://, rediss://, redis+unix://, \
                     redis+cluster:// or rediss+cluster://",
                ))
            }
        };
        let hint = if cluster {
            "name its nodes: redis+cluster://host:port,host:port"
        } else {
            "name a host"
        };
        u.require_base(&[], "server", hint)?;
        let params = u.options(kind, PARAMS)?;
        let mut options = RedisOptions::default();
        if let Some(prefix) = params.text("idem_prefix") {
            options = options.with_key_prefix(prefix);
            options.validate().map_err(|e| match e {
                StoreError::Config(m) => StoreError::Config(format!("store URL: idem_prefix: {m}")),
                e => e,
            })?;
        }
        let tls = u.scheme().starts_with("rediss");
        options = crate::tls_files::apply(&u, &params, tls, options)?;
        Ok(Self {
            url: params.driver_url().clone(),
            options,
            cluster,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config_error(url: &str) -> String {
        match RedisUrl::parse(url) {
            Err(StoreError::Config(m)) => m,
            other => panic!("{url}: not a config error: {other:?}"),
        }
    }

    #[test]
    fn gateway_parameters_are_taken_out_of_the_driver_url() {
        let u = RedisUrl::parse("redis://h:6379/2?idem_prefix=pay%3Av2").unwrap();
        assert_eq!(u.url.expose(), "redis://h:6379/2");
        assert_eq!(u.options.key_prefix, "pay:v2");
        assert!(!u.cluster);

        let u =
            RedisUrl::parse("redis+cluster://h:7000,h:7001/?protocol=resp3&idem_prefix=x").unwrap();
        assert_eq!(
            u.url.expose(),
            "redis+cluster://h:7000,h:7001/?protocol=resp3"
        );
        assert_eq!(u.options.key_prefix, "x");
        assert!(u.cluster);

        let u = RedisUrl::parse("REDISS://h:6380").unwrap();
        assert_eq!(u.url.expose(), "rediss://h:6380");
        assert_eq!(u.options.key_prefix, RedisOptions::default().key_prefix);
        assert!(RedisUrl::parse("redis+unix:///run/redis.sock").is_ok());
        assert!(RedisUrl::parse("rediss+cluster://h:7000").unwrap().cluster);
    }

    #[test]
    fn bad_parameters_are_config_errors() {
        for bad in [
            "redis://",
            "redis+cluster://",
            "postgres://h/db",
            "redis://h?idem_table=t",
            "redis://h?idem_prefix=a%7Bb",
            "redis://h?idem_prefix=%ZZ",
            "redis://h?idem_prefix=",
            "redis://h?idem_prefix=a&idem_prefix=b",
        ] {
            config_error(bad);
        }
        assert_eq!(
            config_error("redis+cluster://"),
            "store URL \"redis+cluster://\" names no server; \
             name its nodes: redis+cluster://host:port,host:port"
        );
        assert_eq!(
            config_error("redis://:s3cret@h?idem_schema=x"),
            "store URL \"redis://:***@h?idem_schema=x\": unknown parameter \"idem_schema\"; \
             redis store URLs take idem_prefix, idem_tls_ca, idem_tls_cert, idem_tls_key"
        );
        assert!(config_error("redis+cluster://h:1?idem_x=1").ends_with(
            "redis-cluster store URLs take idem_prefix, idem_tls_ca, idem_tls_cert, idem_tls_key"
        ));
        assert!(config_error("redis://h?idem_prefix=a%7Bb").starts_with("store URL: idem_prefix: "));
    }

    #[test]
    fn insecure_and_other_fragments_are_refused() {
        for url in [
            "rediss://h:6380#insecure",
            "rediss://h:6380/?idem_prefix=x#insecure",
            "rediss+cluster://h:1,h:2#insecure",
            "redis://h#x",
        ] {
            let m = config_error(url);
            assert!(
                m.contains("#insecure (no certificate check) is refused"),
                "{m}"
            );
            assert!(m.contains("idem_tls_ca"), "{m}");
        }
    }

    #[test]
    fn tls_parameters_need_a_tls_url() {
        for url in [
            "redis://h?idem_tls_ca=/ca.pem",
            "redis+cluster://h:1?idem_tls_cert=/c&idem_tls_key=/k",
            "redis+unix:///s.sock?idem_tls_ca=/ca.pem",
        ] {
            assert!(
                config_error(url).contains("is for TLS connections; use rediss://"),
                "{url}"
            );
        }
    }

    #[cfg(feature = "tls")]
    #[test]
    fn tls_files_are_read_and_checked() {
        use idem_testkit::pki::{TestCa, Usage};
        let dir = tempfile::tempdir().unwrap();
        let ca = TestCa::new("ca");
        let ca_path = ca.write(dir.path(), "ca.pem");
        let (cert, key) = ca
            .issue(&["client"], Usage::Client)
            .write(dir.path(), "client");
        let (ca_s, cert_s, key_s) = (
            ca_path.display().to_string(),
            cert.display().to_string(),
            key.display().to_string(),
        );

        let u = RedisUrl::parse(&format!(
            "rediss://h:6380/?protocol=resp3&idem_tls_ca={ca_s}&idem_tls_cert={cert_s}&idem_tls_key={key_s}"
        ))
        .unwrap();
        assert_eq!(u.url.expose(), "rediss://h:6380/?protocol=resp3");
        assert_eq!(
            u.options.tls_root_cert_pem.as_deref(),
            Some(ca.cert_pem.as_bytes())
        );
        let id = u.options.tls_client.clone().expect("client identity");
        assert_eq!(id.cert_pem, std::fs::read(&cert).unwrap());
        assert!(!format!("{:?}", u.options).contains("PRIVATE KEY"));
        let u = RedisUrl::parse(&format!("rediss+cluster://h:1,h:2?idem_tls_ca={ca_s}")).unwrap();
        assert!(u.cluster && u.options.tls_root_cert_pem.is_some());
        assert!(u.options.tls_client.is_none());

        let missing = dir.path().join("nope.pem").display().to_string();
        let m = config_error(&format!("rediss://h?idem_tls_ca={missing}"));
        assert!(m.contains("idem_tls_ca") && m.contains("nope.pem"), "{m}");
        let m = config_error(&format!("rediss://h?idem_tls_ca={key_s}"));
        assert!(m.contains("holds no PEM certificate"), "{m}");
        let m = config_error(&format!(
            "rediss://h?idem_tls_cert={cert_s}&idem_tls_key={cert_s}"
        ));
        assert!(m.contains("holds no PEM private key"), "{m}");
        assert!(config_error(&format!("rediss://h?idem_tls_cert={cert_s}"))
            .contains("idem_tls_cert needs idem_tls_key"));
        assert!(config_error(&format!("rediss://h?idem_tls_key={key_s}"))
            .contains("idem_tls_key needs idem_tls_cert"));
    }
}
