//! The TLS files a Redis store URL names (`idem_tls_ca`, `idem_tls_cert`,
//! `idem_tls_key`): read and checked when the URL is read, so a wrong path
//! or a file of the wrong kind is a configuration error at start.

use idem_core::url::{StoreUrl, UrlOptions};
use idem_core::StoreError;

use crate::RedisOptions;

/// The URL's `idem_tls_*` parameters, by name.
const TLS_PARAMS: [&str; 3] = ["idem_tls_ca", "idem_tls_cert", "idem_tls_key"];

/// Applies the `idem_tls_*` parameters of `u` to `options`; `tls` is whether
/// the scheme is `rediss` or `rediss+cluster`.
pub(crate) fn apply(
    u: &StoreUrl,
    params: &UrlOptions,
    tls: bool,
    options: RedisOptions,
) -> Result<RedisOptions, StoreError> {
    let Some(given) = TLS_PARAMS.into_iter().find(|p| params.text(p).is_some()) else {
        return Ok(options);
    };
    if !tls {
        return Err(u.error(format_args!(
            "{given} is for TLS connections; use rediss:// (or rediss+cluster://)"
        )));
    }
    read(u, params, options)
}

#[cfg(not(feature = "tls"))]
fn read(
    u: &StoreUrl,
    _params: &UrlOptions,
    _options: RedisOptions,
) -> Result<RedisOptions, StoreError> {
    Err(u.error("idem_tls_* parameters need idem-redis's `tls` feature"))
}

#[cfg(feature = "tls")]
fn read(
    u: &StoreUrl,
    params: &UrlOptions,
    mut options: RedisOptions,
) -> Result<RedisOptions, StoreError> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::PrivateKeyDer;

    if let Some(path) = params.text("idem_tls_ca") {
        let pem = file(u, "idem_tls_ca", path)?;
        certificates(u, "idem_tls_ca", path, &pem)?;
        options = options.with_tls_root_cert_pem(pem);
    }
    match (params.text("idem_tls_cert"), params.text("idem_tls_key")) {
        (None, None) => {}
        (Some(cert), Some(key)) => {
            let cert_pem = file(u, "idem_tls_cert", cert)?;
            certificates(u, "idem_tls_cert", cert, &cert_pem)?;
            let key_pem = file(u, "idem_tls_key", key)?;
            if PrivateKeyDer::from_pem_slice(&key_pem).is_err() {
                return Err(u.error(format_args!(
                    "idem_tls_key {key:?} holds no PEM private key (PKCS#8, PKCS#1 or SEC1)"
                )));
            }
            options = options.with_tls_client(crate::TlsClientIdentity::new(cert_pem, key_pem));
        }
        (Some(_), None) => return Err(u.error("idem_tls_cert needs idem_tls_key")),
        (None, Some(_)) => return Err(u.error("idem_tls_key needs idem_tls_cert")),
    }

    Ok(options)
}

/// The file's bytes.
#[cfg(feature = "tls")]
fn file(u: &StoreUrl, param: &str, path: &str) -> Result<Vec<u8>, StoreError> {
    std::fs::read(path).map_err(|e| u.error(format_args!("{param} {path:?}: {e}")))
}

/// Checks that `pem` holds at least one certificate and nothing
/// malformed.
#[cfg(feature = "tls")]
fn certificates(u: &StoreUrl, param: &str, path: &str, pem: &[u8]) -> Result<(), StoreError> {
    use rustls::pki_types::pem::PemObject;
    let certs: Result<Vec<_>, _> = rustls::pki_types::CertificateDer::pem_slice_iter(pem).collect();
    match certs {
        Ok(c) if !c.is_empty() => Ok(()),
        Ok(_) => Err(u.error(format_args!(
            "{param} {path:?} holds no PEM certificate (-----BEGIN CERTIFICATE-----)"
        ))),
        Err(e) => Err(u.error(format_args!("{param} {path:?}: bad PEM: {e}"))),
    }
}
