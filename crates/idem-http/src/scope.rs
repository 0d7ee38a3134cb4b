//! Deriving a request's [`Scope`]: whose key it is.

use http::{header, Extensions, HeaderMap, HeaderName};
use idem_core::Scope;

/// The domain-separation tag of a client-certificate scope: the first part
/// [`Scope::hashed`] takes before the certificate's DER. It contains `:`,
/// which no header name may (RFC 9110 §5.1), so a certificate-derived scope
/// can never equal a header-derived one (whose parts start with a header
/// name).
pub const CLIENT_CERT_SCOPE_TAG: &[u8] = b"idem:client-cert:v1";

/// The verified TLS client certificate of the connection a request came on
/// (its leaf, DER bytes): what [`ScopeBy::ClientCert`] scopes by.
///
/// A server that verifies client certificates (mTLS) puts one in each
/// request's extensions ([`http::Request::extensions_mut`]) *only* for a
/// certificate its TLS stack has verified; the layer trusts it as it is.
/// `idem gateway` does so on every request of a connection made with
/// `--tls-client-ca`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ClientCertificate(pub bytes::Bytes);

/// Why a request has no scope: [`ScopeBy::ClientCert`] and no
/// [`ClientCertificate`] in its extensions. Answered 400
/// `client-certificate-required`; never the anonymous scope.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the scope is taken from the TLS client certificate, and this request came without one")]
pub struct ClientCertificateRequired;

/// How the scope of a request is derived. Two scopes never see each
/// other's records, so two callers that pick the same key stay apart
/// (CASES E3).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ScopeBy {
    /// SHA-256 over every value of these headers, in order (default:
    /// `Authorization`); none present → the anonymous scope.
    ///
    /// Exactly: [`Scope::hashed`] over the pairs (header name, value) for
    /// every field of the listed headers, headers in the listed order and
    /// fields of one header in the order received. The name is part of the
    /// hash, so the same value under two different headers gives two
    /// scopes. A present but empty field counts (it is not anonymous).
    Headers(Vec<HeaderName>),
    /// One fixed scope for every request.
    Fixed(Scope),
    /// The verified TLS client certificate ([`ClientCertificate`] in the
    /// request's extensions): [`Scope::hashed`] over
    /// ([`CLIENT_CERT_SCOPE_TAG`], the leaf's DER). The same certificate
    /// is one scope across connections and restarts; a renewed certificate
    /// (new DER) is a new scope. A request without the extension has no
    /// scope ([`ClientCertificateRequired`]): it is refused, never put in
    /// the anonymous scope.
    ClientCert,
}

impl Default for ScopeBy {
    /// `Headers([Authorization])`.
    fn default() -> Self {
        Self::authorization()
    }
}

impl ScopeBy {
    /// `Headers([Authorization])`, the default.
    pub fn authorization() -> Self {
        Self::Headers(vec![header::AUTHORIZATION])
    }

    /// The scope of a request with these headers.
    ///
    /// Headers alone cannot name a [`ScopeBy::ClientCert`] scope: for it
    /// this returns the scope of *no* certificate, which callers must not
    /// use; the layer calls [`ScopeBy::scope_in`], which refuses instead.
    ///
    /// ```
    /// use http::HeaderMap;
    /// use idem_http::ScopeBy;
    /// let mut h = HeaderMap::new();
    /// assert_eq!(ScopeBy::default().scope_of(&h), idem_core::Scope::anonymous());
    /// h.insert("authorization", "Bearer a".parse().unwrap());
    /// assert_eq!(ScopeBy::default().scope_of(&h).as_str().len(), 64);
    /// ```
    pub fn scope_of(&self, headers: &HeaderMap) -> Scope {
        self.scope_in(headers, &Extensions::new())
            .unwrap_or_else(|ClientCertificateRequired| Scope::hashed([CLIENT_CERT_SCOPE_TAG]))
    }

    /// The scope of a request with these headers and extensions (where a
    /// server puts the [`ClientCertificate`] of an mTLS connection).
    ///
    /// ```
    /// use idem_http::{ClientCertificate, ScopeBy};
    /// let (h, mut ext) = (http::HeaderMap::new(), http::Extensions::new());
    /// assert!(ScopeBy::ClientCert.scope_in(&h, &ext).is_err());
    /// ext.insert(ClientCertificate(bytes::Bytes::from_static(b"der")));
    /// assert_eq!(ScopeBy::ClientCert.scope_in(&h, &ext).unwrap().as_str().len(), 64);
    /// ```
    ///
    /// # Errors
    /// [`ClientCertificateRequired`] under [`ScopeBy::ClientCert`] when the
    /// extensions hold no [`ClientCertificate`].
    pub fn scope_in(
        &self,
        headers: &HeaderMap,
        extensions: &Extensions,
    ) -> Result<Scope, ClientCertificateRequired> {
        Ok(match self {
            ScopeBy::Fixed(scope) => scope.clone(),
            ScopeBy::ClientCert => match extensions.get::<ClientCertificate>() {
                Some(ClientCertificate(der)) => Scope::hashed([CLIENT_CERT_SCOPE_TAG, der]),
                None => return Err(ClientCertificateRequired),
            },
            ScopeBy::Headers(names) => {
                let mut parts: Vec<&[u8]> = Vec::new();
                for name in names {
                    for value in headers.get_all(name) {
                        parts.push(name.as_str().as_bytes());
                        parts.push(value.as_bytes());
                    }
                }
                if parts.is_empty() {
                    Scope::anonymous()
                } else {
                    Scope::hashed(parts)
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (n, v) in pairs {
            h.append(*n, HeaderValue::from_static(v));
        }
        h
    }

    #[test]
    fn no_credentials_is_anonymous() {
        let by = ScopeBy::default();
        assert_eq!(by.scope_of(&HeaderMap::new()), Scope::anonymous());
        assert_eq!(
            by.scope_of(&headers(&[("x-api-key", "k")])),
            Scope::anonymous()
        );
    }

    #[test]
    fn different_credentials_give_different_scopes() {
        let by = ScopeBy::default();
        let a = by.scope_of(&headers(&[("authorization", "Bearer a")]));
        let b = by.scope_of(&headers(&[("authorization", "Bearer b")]));
        assert_ne!(a, b);
        assert_ne!(a, Scope::anonymous());
        assert_eq!(a, by.scope_of(&headers(&[("authorization", "Bearer a")])));
    }

    #[test]
    fn several_authorization_fields_are_hashed_in_order() {
        let by = ScopeBy::default();
        let ab = by.scope_of(&headers(&[("authorization", "a"), ("authorization", "b")]));
        let ba = by.scope_of(&headers(&[("authorization", "b"), ("authorization", "a")]));
        let a = by.scope_of(&headers(&[("authorization", "a")]));
        assert_ne!(ab, ba);
        assert_ne!(ab, a);
        assert_eq!(
            ab,
            Scope::hashed([b"authorization".as_slice(), b"a", b"authorization", b"b"])
        );
    }

    #[test]
    fn header_names_are_part_of_the_scope() {
        let by = ScopeBy::Headers(vec![
            HeaderName::from_static("authorization"),
            HeaderName::from_static("x-api-key"),
        ]);
        let via_auth = by.scope_of(&headers(&[("authorization", "k")]));
        let via_key = by.scope_of(&headers(&[("x-api-key", "k")]));
        assert_ne!(via_auth, via_key);
        let empty = by.scope_of(&headers(&[("x-api-key", "")]));
        assert_ne!(empty, Scope::anonymous());
    }

    #[test]
    fn client_certificates_scope_apart_from_headers() {
        let by = ScopeBy::ClientCert;
        let h = headers(&[("authorization", "a")]);
        assert_eq!(
            by.scope_in(&h, &Extensions::new()),
            Err(ClientCertificateRequired)
        );
        let with = |der: &'static [u8]| {
            let mut e = Extensions::new();
            e.insert(ClientCertificate(bytes::Bytes::from_static(der)));
            by.scope_in(&h, &e).unwrap()
        };
        let (a, b) = (with(b"cert-a"), with(b"cert-b"));
        assert_ne!(a, b);
        assert_eq!(a, with(b"cert-a"));
        assert_ne!(a, Scope::anonymous());
        // Not the scope of a header whose value is the DER.
        let mut h = HeaderMap::new();
        h.insert("authorization", HeaderValue::from_static("cert-a"));
        assert_ne!(a, ScopeBy::default().scope_of(&h));
        // Without extensions, scope_of gives neither anonymous nor a cert's scope.
        let none = by.scope_of(&h);
        assert_ne!(none, Scope::anonymous());
        assert_ne!(none, a);
        // Other kinds ignore the extension.
        let mut e = Extensions::new();
        e.insert(ClientCertificate(bytes::Bytes::from_static(b"cert-a")));
        assert_eq!(
            ScopeBy::default().scope_in(&h, &e).unwrap(),
            ScopeBy::default().scope_of(&h)
        );
    }

    #[test]
    fn fixed_scope() {
        let s = Scope::new("tenant-1").unwrap();
        let by = ScopeBy::Fixed(s.clone());
        assert_eq!(by.scope_of(&headers(&[("authorization", "a")])), s);
    }
}
