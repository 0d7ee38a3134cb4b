//! Deriving a request's [`Scope`]: whose key it is.

use http::{header, HeaderMap, HeaderName};
use idem_core::Scope;

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
    /// ```
    /// use http::HeaderMap;
    /// use idem_http::ScopeBy;
    /// let mut h = HeaderMap::new();
    /// assert_eq!(ScopeBy::default().scope_of(&h), idem_core::Scope::anonymous());
    /// h.insert("authorization", "Bearer a".parse().unwrap());
    /// assert_eq!(ScopeBy::default().scope_of(&h).as_str().len(), 64);
    /// ```
    pub fn scope_of(&self, headers: &HeaderMap) -> Scope {
        match self {
            ScopeBy::Fixed(scope) => scope.clone(),
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
        }
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
    fn fixed_scope() {
        let s = Scope::new("tenant-1").unwrap();
        let by = ScopeBy::Fixed(s.clone());
        assert_eq!(by.scope_of(&headers(&[("authorization", "a")])), s);
    }
}
