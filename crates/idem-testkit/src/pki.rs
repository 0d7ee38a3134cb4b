//! A throw-away PKI for TLS tests: a CA, and server and client
//! certificates it signs, written as PEM files in a temporary folder
//! (rcgen, ECDSA P-256). Nothing here is for production use.

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose,
};

/// A test certificate authority.
pub struct TestCa {
    issuer: Issuer<'static, KeyPair>,
    /// The CA certificate, PEM.
    pub cert_pem: String,
}

impl std::fmt::Debug for TestCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestCa").finish_non_exhaustive()
    }
}

/// A certificate and its key, PEM, and where they were written.
#[derive(Debug, Clone)]
pub struct Issued {
    /// The certificate, PEM (leaf only; the CA is not appended).
    pub cert_pem: String,
    /// Its private key, PEM (PKCS#8).
    pub key_pem: String,
    /// The certificate's DER bytes.
    pub cert_der: Vec<u8>,
}

/// What kind of certificate to issue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Usage {
    /// A TLS server certificate (serverAuth).
    Server,
    /// A TLS client certificate (clientAuth).
    Client,
}

impl TestCa {
    /// A new CA named `name` (its common name).
    ///
    /// # Panics
    /// When rcgen cannot make a key or a certificate (a test setup fault).
    pub fn new(name: &str) -> TestCa {
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("params");
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, name);
        params.distinguished_name = dn;
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let key = KeyPair::generate().expect("key");
        let cert = params.self_signed(&key).expect("CA certificate");
        TestCa {
            cert_pem: cert.pem(),
            issuer: Issuer::new(params, key),
        }
    }

    /// A certificate for `names` (DNS names or IP addresses, the first also
    /// its common name), valid from a day ago for a year.
    ///
    /// # Panics
    /// As [`TestCa::new`].
    pub fn issue(&self, names: &[&str], usage: Usage) -> Issued {
        let now = std::time::SystemTime::now();
        self.issue_valid(
            names,
            usage,
            now - std::time::Duration::from_secs(86_400),
            now + std::time::Duration::from_secs(365 * 86_400),
        )
    }

    /// A certificate for `names` valid from `not_before` to `not_after`
    /// (an expired one: both in the past).
    ///
    /// # Panics
    /// As [`TestCa::new`].
    pub fn issue_valid(
        &self,
        names: &[&str],
        usage: Usage,
        not_before: std::time::SystemTime,
        not_after: std::time::SystemTime,
    ) -> Issued {
        let mut params =
            CertificateParams::new(names.iter().map(|s| s.to_string()).collect::<Vec<_>>())
                .expect("params");
        let mut dn = DistinguishedName::new();
        dn.push(
            DnType::CommonName,
            names.first().copied().unwrap_or("client"),
        );
        params.distinguished_name = dn;
        params.not_before = not_before.into();
        params.not_after = not_after.into();
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![match usage {
            Usage::Server => ExtendedKeyUsagePurpose::ServerAuth,
            Usage::Client => ExtendedKeyUsagePurpose::ClientAuth,
        }];
        let key = KeyPair::generate().expect("key");
        let cert = params.signed_by(&key, &self.issuer).expect("certificate");
        Issued {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
            cert_der: cert.der().to_vec(),
        }
    }

    /// Writes the CA certificate to `dir/<name>` and returns its path.
    ///
    /// # Panics
    /// When the file cannot be written.
    pub fn write(&self, dir: &Path, name: &str) -> PathBuf {
        let path = dir.join(name);
        std::fs::write(&path, &self.cert_pem).expect("write CA");
        path
    }
}

impl Issued {
    /// Writes `dir/<stem>.crt` and `dir/<stem>.key` (the key readable by its
    /// owner only) and returns (certificate path, key path).
    ///
    /// # Panics
    /// When a file cannot be written.
    pub fn write(&self, dir: &Path, stem: &str) -> (PathBuf, PathBuf) {
        let cert = dir.join(format!("{stem}.crt"));
        let key = dir.join(format!("{stem}.key"));
        std::fs::write(&cert, &self.cert_pem).expect("write certificate");
        std::fs::write(&key, &self.key_pem).expect("write key");
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600))
                .expect("chmod key");
        }
        (cert, key)
    }
}
