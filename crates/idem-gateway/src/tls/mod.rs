//! TLS: the listener's certificate (reloaded when its files change), the
//! client certificates it may require, and how an `https://` upstream is
//! trusted. rustls with the *ring* provider throughout; certificates and
//! keys are PEM files (RFC 7468).
//!
//! - [`listener`]: `--tls-cert`/`--tls-key` (ALPN `h2`, `http/1.1`),
//!   `--tls-client-ca` (mTLS), certificate rotation without a restart.
//! - [`upstream`]: the connector for `https://` upstreams (system roots or
//!   `--upstream-ca`, SNI and name check from the URL host, optional client
//!   certificate), and HTTP/2 to the upstream (`--upstream-http2`).

use std::path::{Path, PathBuf};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

pub(crate) mod listener;
pub(crate) mod upstream;

/// TLS on the gateway's listener (`--tls-cert`, `--tls-key`,
/// `--tls-client-ca`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ListenerTls {
    /// The certificate chain, PEM, leaf first.
    pub cert: PathBuf,
    /// Its private key, PEM (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// CAs (PEM) whose client certificates are required and accepted;
    /// none: no client certificate is asked for.
    pub client_ca: Option<PathBuf>,
}

/// How an `https://` upstream is trusted and what it is shown. The default
/// trusts the system's roots and shows no client certificate.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct UpstreamTls {
    /// Trust only these CAs (PEM) instead of the system's roots
    /// (`--upstream-ca`).
    pub ca: Option<PathBuf>,
    /// A client certificate chain, PEM (`--upstream-client-cert`).
    pub client_cert: Option<PathBuf>,
    /// Its private key, PEM (`--upstream-client-key`).
    pub client_key: Option<PathBuf>,
}

/// A certificate, key or CA file that cannot be used, or a TLS setup that
/// rustls refuses. Each names the file and the flag it came from.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// The file cannot be read.
    #[error("{flag} {}: cannot read it: {source}", path.display())]
    Read {
        /// The flag that named the file.
        flag: &'static str,
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The file holds no PEM block of the kind needed, or a malformed one.
    #[error("{flag} {}: {what}", path.display())]
    Pem {
        /// The flag that named the file.
        flag: &'static str,
        /// The file.
        path: PathBuf,
        /// What is wrong ("no CERTIFICATE block", …).
        what: String,
    },
    /// rustls refuses the certificates or the key (e.g. the key does not
    /// match the certificate).
    #[error("{flag}: {source}")]
    Rustls {
        /// The flag (or flags) concerned.
        flag: &'static str,
        /// rustls's reason.
        source: rustls::Error,
    },
    /// The system's root certificates cannot be loaded, and no
    /// `--upstream-ca` is given.
    #[error("no system root certificates could be loaded ({0}); name a CA with --upstream-ca")]
    NoRoots(String),
}

fn read(flag: &'static str, path: &Path) -> Result<Vec<u8>, TlsError> {
    read_pem_file(path)
        .map(|(_, content)| content)
        .map_err(|source| TlsError::Read {
            flag,
            path: path.to_owned(),
            source,
        })
}

/// The most of a certificate, key or CA file read: 1 MiB (a chain of a
/// dozen certificates is a few tens of KiB).
pub(crate) const MAX_PEM: u64 = 1 << 20;

/// A certificate, key or CA file's metadata and content: a regular file (a
/// symlink to one is followed) of at most [`MAX_PEM`] bytes. It is opened
/// without blocking (`O_NONBLOCK`), so a FIFO or a device put at the path is
/// refused, never waited on.
///
/// # Errors
/// The open's or read's error; `InvalidInput` for something that is not a
/// regular file or is larger than [`MAX_PEM`].
pub(crate) fn read_pem_file(path: &Path) -> std::io::Result<(std::fs::Metadata, Vec<u8>)> {
    use std::io::{Error, ErrorKind, Read as _};
    let mut open = std::fs::OpenOptions::new();
    open.read(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt as _;
        open.custom_flags(rustix::fs::OFlags::NONBLOCK.bits() as i32);
    }
    let file = open.open(path)?;
    let meta = file.metadata()?;
    if !meta.is_file() {
        return Err(Error::new(ErrorKind::InvalidInput, "not a regular file"));
    }
    let mut content = Vec::new();
    file.take(MAX_PEM + 1).read_to_end(&mut content)?;
    if content.len() as u64 > MAX_PEM {
        return Err(Error::new(
            ErrorKind::InvalidInput,
            format!("larger than {MAX_PEM} bytes: not a PEM certificate or key file"),
        ));
    }
    Ok((meta, content))
}

/// Every `CERTIFICATE` block of a PEM file, in order.
///
/// # Errors
/// [`TlsError::Read`], or [`TlsError::Pem`] when the file holds no
/// certificate or a malformed block.
pub(crate) fn load_certs(
    flag: &'static str,
    path: &Path,
) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let pem = read(flag, path)?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsError::Pem {
            flag,
            path: path.to_owned(),
            what: format!("malformed PEM: {e}"),
        })?;
    if certs.is_empty() {
        return Err(TlsError::Pem {
            flag,
            path: path.to_owned(),
            what: "no CERTIFICATE block".into(),
        });
    }
    Ok(certs)
}

/// The first private key of a PEM file (PKCS#8, PKCS#1 or SEC1).
///
/// # Errors
/// [`TlsError::Read`], or [`TlsError::Pem`] when the file holds no key.
pub(crate) fn load_key(
    flag: &'static str,
    path: &Path,
) -> Result<PrivateKeyDer<'static>, TlsError> {
    let pem = read(flag, path)?;
    PrivateKeyDer::from_pem_slice(&pem).map_err(|e| TlsError::Pem {
        flag,
        path: path.to_owned(),
        what: format!("no usable PRIVATE KEY block ({e})"),
    })
}
