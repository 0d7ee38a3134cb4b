//! Per-route rules: an ordered list of [`Route`]s, first match wins, each
//! with its own complete [`Options`] (TTL, lease, wait, key source,
//! fingerprint, status policy, scope, limits).
//!
//! A request is matched on its method (one of the route's
//! [`Options::methods`]) and its path against the route's [`PathPattern`];
//! the path is judged in the same form as the token routes (normalised by
//! [`crate::path::normalize_path`], then fully percent-decoded and
//! lower-cased), so no spelling of a path escapes the rules written for it.
//! A request no route matches is judged by the layer's own options (the
//! route named `default`).
//!
//! Routes are given to the layer with
//! [`crate::IdempotencyLayer::with_routes`] and replaced while it serves
//! with [`crate::IdempotencyLayer::reload`]: a request keeps the rules it
//! started with.

use std::sync::Arc;

use http::Method;
use idem_core::{DynStore, Engine};

use crate::observe::Observer;
use crate::options::Options;
use crate::path::{normalize_path, rule_form};

pub use crate::key::KeySource;
pub use crate::observe::DEFAULT_ROUTE;
/// The longest route name, bytes: 64 (it is a metric label).
pub const MAX_ROUTE_NAME: usize = 64;
/// The most routes in one table: 1,000 (each request may try every one).
pub const MAX_ROUTES: usize = 1000;

/// A path pattern: segments matched one by one against the request path,
/// as a prefix by segment. `/payments` matches `/payments`, `/payments/`
/// and `/payments/42`, not `/paymentsx`; `/orders/{id}/items` matches
/// `/orders/7/items` and `/orders/7/items/3`; `{name}` matches exactly one
/// non-empty segment. `/` matches every path. Matching ignores letter case
/// and percent-encoding (see the [module docs](self)).
///
/// ```
/// use idem_http::routes::PathPattern;
/// let p: PathPattern = "/orders/{id}/items".parse().unwrap();
/// assert!(p.matches("/orders/7/items"));
/// assert!(p.matches("/ORDERS/7/items/3"));
/// assert!(p.matches("/orders/%37/items"));
/// assert!(!p.matches("/orders/items"));
/// assert!(!p.matches("/orders//items"));
/// assert!(!p.matches("/orders/7/itemsx"));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PathPattern {
    /// As written.
    raw: String,
    /// In rule form; `None` for a `{placeholder}`.
    segments: Vec<Option<Vec<u8>>>,
}

/// Why a path pattern, a route or a route table was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RouteError {
    /// The pattern is not a path starting with `/`, or is ambiguous.
    #[error("path pattern {pattern:?}: {reason}")]
    Pattern {
        /// The pattern as written.
        pattern: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A route name that is empty, too long, not `[A-Za-z0-9_.-]`, or
    /// `default`.
    #[error(
        "route name {0:?} must be 1 to 64 characters of A-Z a-z 0-9 _ . - and not \"default\""
    )]
    Name(String),
    /// Two routes with one name.
    #[error("two routes are named {0:?}")]
    DuplicateName(String),
    /// More than [`MAX_ROUTES`] routes.
    #[error("{0} routes; at most 1000")]
    TooMany(usize),
    /// A route's settings void the guarantee or contradict each other.
    #[error("route {route:?}: {reason}")]
    Invalid {
        /// The route's name.
        route: String,
        /// What is wrong.
        reason: String,
    },
}

impl std::str::FromStr for PathPattern {
    type Err = RouteError;

    /// Parses a pattern: it starts with `/`; a segment is a literal
    /// (normalised like a request path) or a whole `{name}` placeholder.
    ///
    /// # Errors
    /// [`RouteError::Pattern`] for a pattern that does not start with `/`,
    /// an ambiguous spelling ([`crate::path::PathError`]), an empty segment
    /// (`//`), or a `{` or `}` inside a segment.
    fn from_str(raw: &str) -> Result<Self, RouteError> {
        let err = |reason: String| RouteError::Pattern {
            pattern: raw.to_owned(),
            reason,
        };
        if !raw.starts_with('/') {
            return Err(err("must start with '/'".into()));
        }
        if raw.contains("//") {
            return Err(err("has an empty segment ('//')".into()));
        }
        if let Some(c) = raw
            .chars()
            .find(|c| matches!(c, '*' | '?' | '#') || c.is_whitespace())
        {
            return Err(err(format!(
                "{c:?} is not allowed: a pattern is a path prefix matched by segment (`/a` \
                 covers `/a/b`), with `{{name}}` for one segment; no wildcards, query or fragment"
            )));
        }
        let mut segments = Vec::new();
        for seg in raw[1..].split('/') {
            if seg.is_empty() {
                // A trailing slash: `/a/` is the prefix `/a`.
                continue;
            }
            if seg.starts_with('{') && seg.ends_with('}') && seg.len() > 2 {
                let name = &seg[1..seg.len() - 1];
                if name.contains(['{', '}']) {
                    return Err(err(format!("segment {seg:?} is not one placeholder")));
                }
                segments.push(None);
                continue;
            }
            if seg.contains(['{', '}']) {
                return Err(err(format!(
                    "segment {seg:?}: a placeholder is a whole segment, like {{id}}"
                )));
            }
            let one = format!("/{seg}");
            let normal = normalize_path(&one).map_err(|e| err(e.to_string()))?;
            if normal.len() <= 1 || normal[1..].contains('/') {
                return Err(err(format!("segment {seg:?} is a dot segment")));
            }
            segments.push(Some(rule_form(&normal[1..])));
        }
        Ok(Self {
            raw: raw.to_owned(),
            segments,
        })
    }
}

impl std::fmt::Display for PathPattern {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.raw)
    }
}

impl PathPattern {
    /// The pattern as written.
    pub fn as_str(&self) -> &str {
        &self.raw
    }

    /// Whether the request path `path` (as received: it is normalised
    /// here) matches. A path that cannot be normalised matches no pattern
    /// (the layer refuses such paths on guarded methods before it asks).
    pub fn matches(&self, path: &str) -> bool {
        match normalize_path(path) {
            Ok(p) => self.matches_rule_form(&rule_form(&p)),
            Err(_) => false,
        }
    }

    /// Whether a path already in rule form (normalised, decoded,
    /// lower-cased) matches.
    pub(crate) fn matches_rule_form(&self, path: &[u8]) -> bool {
        let mut rest = path.strip_prefix(b"/").unwrap_or(path);
        for seg in &self.segments {
            if rest.is_empty() {
                return false;
            }
            let (head, tail) = match rest.iter().position(|&c| c == b'/') {
                Some(i) => (&rest[..i], &rest[i + 1..]),
                None => (rest, &rest[rest.len()..]),
            };
            match seg {
                None if head.is_empty() => return false,
                None => {}
                Some(lit) if lit.as_slice() != head => return false,
                Some(_) => {}
            }
            rest = tail;
        }
        true
    }
}

/// One route: which requests it covers and the complete settings they get.
///
/// Build its [`Options`] from the layer's (`..layer_options.clone()`) and
/// change what the route changes. Layer-wide settings in a route's options
/// are ignored: `max_buffered`, `body_timeout`, `token_ttl`,
/// `tokens_per_scope`, `max_live_tokens`, `anonymous_tokens`, `fail_open`,
/// `access_log`, `require_token` (the token prefixes hold on every route).
#[derive(Debug, Clone)]
pub struct Route {
    /// The name in logs and in the `route` label of the request metrics
    /// (1 to [`MAX_ROUTE_NAME`] characters of `A-Z a-z 0-9 _ . -`, not
    /// [`DEFAULT_ROUTE`]).
    pub name: String,
    /// The paths covered.
    pub path: PathPattern,
    /// `false`: the route's requests are passed through untouched (no key,
    /// no store), like requests of unguarded methods.
    pub guard: bool,
    /// The route's keys must be live submit tokens ([`Options::require_token`]
    /// explains the answers), whatever the token prefixes say.
    pub require_token: bool,
    /// The route's settings; `options.methods` are the methods it covers.
    pub options: Options,
}

impl Route {
    /// A guarded route named `name` over `path` with `options`.
    ///
    /// # Errors
    /// [`RouteError::Pattern`] for a bad `path`.
    pub fn new(name: impl Into<String>, path: &str, options: Options) -> Result<Self, RouteError> {
        Ok(Self {
            name: name.into(),
            path: path.parse()?,
            guard: true,
            require_token: false,
            options,
        })
    }
}

/// Checks a table: names, count, and each route's settings as
/// [`Options::validate`] checks the layer's.
///
/// # Errors
/// The first problem, as a [`RouteError`].
pub fn validate_routes(routes: &[Route]) -> Result<(), RouteError> {
    if routes.len() > MAX_ROUTES {
        return Err(RouteError::TooMany(routes.len()));
    }
    let mut seen = std::collections::HashSet::new();
    for r in routes {
        let ok = !r.name.is_empty()
            && r.name.len() <= MAX_ROUTE_NAME
            && r.name != DEFAULT_ROUTE
            && r.name
                .bytes()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'_' | b'.' | b'-'));
        if !ok {
            return Err(RouteError::Name(r.name.clone()));
        }
        if !seen.insert(r.name.as_str()) {
            return Err(RouteError::DuplicateName(r.name.clone()));
        }
        let invalid = |reason: String| RouteError::Invalid {
            route: r.name.clone(),
            reason,
        };
        if r.options.methods.is_empty() {
            return Err(invalid("no method".into()));
        }
        if r.guard {
            r.options.validate().map_err(|e| invalid(e.to_string()))?;
            if r.options.max_body == 0 {
                return Err(invalid("max_body is 0".into()));
            }
            if let KeySource::JsonPointer(p) = &r.options.key_source {
                crate::body_key::validate_pointer(p)
                    .map_err(|e| invalid(format!("key_json_pointer {p:?}: {e}")))?;
            }
            r.options
                .fingerprint
                .validate()
                .map_err(|e| invalid(format!("fingerprint: {e}")))?;
        }
    }
    Ok(())
}

/// One route as the services apply it: its settings (layer-wide fields
/// taken from the layer), its engine and its metric handles.
#[derive(Debug)]
pub(crate) struct Rules {
    /// [`Route::name`], or [`DEFAULT_ROUTE`].
    pub(crate) name: Arc<str>,
    /// `None` for the default route (every path).
    pattern: Option<PathPattern>,
    pub(crate) guard: bool,
    /// [`Route::require_token`].
    pub(crate) token: bool,
    pub(crate) options: Arc<Options>,
    pub(crate) engine: Engine<DynStore>,
    pub(crate) observer: Arc<Observer>,
}

impl Rules {
    fn new(
        name: &str,
        pattern: Option<PathPattern>,
        (guard, token): (bool, bool),
        route: &Options,
        layer: &Options,
        store: &DynStore,
    ) -> Self {
        // The layer-wide settings are the layer's, whatever the route says.
        let options = Options {
            max_buffered: layer.max_buffered,
            body_timeout: layer.body_timeout,
            token_ttl: layer.token_ttl,
            tokens_per_scope: layer.tokens_per_scope,
            max_live_tokens: layer.max_live_tokens,
            anonymous_tokens: layer.anonymous_tokens,
            fail_open: layer.fail_open.clone(),
            access_log: layer.access_log,
            require_token: layer.require_token.clone(),
            ..route.clone()
        };
        let mut options = options;
        options.fingerprint.route = name.to_owned();
        Self {
            name: Arc::from(name),
            pattern,
            guard,
            token,
            engine: Engine::with_config(store.clone(), options.engine_config()),
            options: Arc::new(options),
            observer: Arc::new(Observer::for_route(name)),
        }
    }
}

/// The rules in force: the routes in order, then the default.
#[derive(Debug)]
pub(crate) struct Table {
    routes: Vec<Rules>,
    pub(crate) default: Rules,
    /// Every method some guarded rule covers (for the `method-case`
    /// refusal and the fast pass-through of other methods).
    pub(crate) methods: Vec<Method>,
    /// Every method some rule covers, guarded or not (a request of
    /// another method is counted under `default` without matching).
    all_methods: Vec<Method>,
}

impl Table {
    /// The table for `routes` over the per-request settings `defaults` and
    /// the layer-wide settings of `layer`.
    pub(crate) fn new(
        store: &DynStore,
        layer: &Options,
        defaults: &Options,
        routes: &[Route],
    ) -> Self {
        let default = Rules::new(DEFAULT_ROUTE, None, (true, false), defaults, layer, store);
        let routes: Vec<Rules> = routes
            .iter()
            .map(|r| {
                Rules::new(
                    &r.name,
                    Some(r.path.clone()),
                    (r.guard, r.require_token),
                    &r.options,
                    layer,
                    store,
                )
            })
            .collect();
        let mut methods: Vec<Method> = Vec::new();
        let mut all_methods: Vec<Method> = Vec::new();
        for rules in routes.iter().chain(std::iter::once(&default)) {
            for m in &rules.options.methods {
                if rules.guard && !methods.contains(m) {
                    methods.push(m.clone());
                }
                if !all_methods.contains(m) {
                    all_methods.push(m.clone());
                }
            }
        }
        Self {
            routes,
            default,
            methods,
            all_methods,
        }
    }

    /// [`Table::rules_for`] for a normalised path (put in rule form only
    /// when there are routes to match).
    pub(crate) fn rules_for_path(&self, method: &Method, normal_path: &str) -> Option<&Rules> {
        if self.routes.is_empty() {
            return self
                .default
                .options
                .methods
                .contains(method)
                .then_some(&self.default);
        }
        self.rules_for(method, &rule_form(normal_path))
    }

    /// The rules for `method` on a path in rule form: the first route that
    /// covers both, else the default when it covers the method; `None`: no
    /// rule covers this request (pass it through).
    pub(crate) fn rules_for(&self, method: &Method, rule_path: &[u8]) -> Option<&Rules> {
        self.routes
            .iter()
            .find(|r| {
                r.options.methods.contains(method)
                    && r.pattern
                        .as_ref()
                        .is_some_and(|p| p.matches_rule_form(rule_path))
            })
            .or_else(|| {
                self.default
                    .options
                    .methods
                    .contains(method)
                    .then_some(&self.default)
            })
    }

    /// The names of the rules of `self` whose scope or key source differ in
    /// `next` (a route of the same name, or the default).
    pub(crate) fn rekeyed_by(&self, next: &Table) -> Vec<String> {
        let mut out = Vec::new();
        for old in self.routes.iter().chain(std::iter::once(&self.default)) {
            let new = if *old.name == *DEFAULT_ROUTE {
                Some(&next.default)
            } else {
                next.routes.iter().find(|r| r.name == old.name)
            };
            if let Some(new) = new {
                let (a, b) = (&old.options, &new.options);
                if old.guard && new.guard && (a.scope != b.scope || a.key_source != b.key_source) {
                    out.push(old.name.to_string());
                }
            }
        }
        out
    }

    /// The rules a passed-through request is counted under: those that
    /// cover its method and path (a `guard = false` route, or a guarded
    /// one it fell through, e.g. without a key), else the default. Without
    /// routes, or for a method no rule covers, no path is looked at.
    pub(crate) fn counted_under(&self, method: &Method, path: &str) -> &Rules {
        if self.routes.is_empty() || !self.all_methods.contains(method) {
            return &self.default;
        }
        let Ok(normal) = normalize_path(path) else {
            return &self.default;
        };
        self.rules_for(method, &rule_form(&normal))
            .unwrap_or(&self.default)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &str) -> PathPattern {
        s.parse().unwrap()
    }

    #[test]
    fn prefix_by_segment() {
        assert!(p("/payments").matches("/payments"));
        assert!(p("/payments").matches("/payments/"));
        assert!(p("/payments").matches("/payments/1"));
        assert!(p("/payments/").matches("/payments/1"));
        assert!(!p("/payments").matches("/payment"));
        assert!(!p("/payments").matches("/paymentsx"));
        assert!(!p("/payments").matches("/"));
        assert!(p("/").matches("/"));
        assert!(p("/").matches("/anything/at/all"));
    }

    #[test]
    fn every_spelling_of_a_path_matches() {
        for path in [
            "/Payments/1",
            "/%70ayments",
            "//payments",
            "/x/../payments",
            "/./payments",
        ] {
            assert!(p("/payments").matches(path), "{path}");
        }
        assert!(p("/Caf%C3%A9").matches("/café/1"));
        assert!(
            !p("/payments").matches("/payments%2F1"),
            "ambiguous paths match nothing"
        );
    }

    #[test]
    fn placeholders_take_one_segment() {
        let pat = p("/orders/{id}/items");
        assert!(pat.matches("/orders/7/items"));
        assert!(pat.matches("/orders/abc/items/9"));
        assert!(!pat.matches("/orders/7"));
        assert!(!pat.matches("/orders/7/x/items"));
        assert!(p("/{tenant}").matches("/t1"));
        assert!(!p("/{tenant}").matches("/"));
    }

    #[test]
    fn bad_patterns_are_refused() {
        for bad in [
            "payments", "", "/a//b", "/a/{id", "/a/x{id}", "/a%2Fb", "/a/..", "/a;b",
        ] {
            assert!(bad.parse::<PathPattern>().is_err(), "{bad}");
        }
    }

    #[test]
    fn names_are_checked() {
        let route = |name: &str| Route::new(name, "/a", Options::default()).unwrap();
        assert!(validate_routes(&[route("payments"), route("carts.v2")]).is_ok());
        for bad in ["", "default", "a b", "ü", &"x".repeat(65)] {
            assert!(validate_routes(&[route(bad)]).is_err(), "{bad:?}");
        }
        assert_eq!(
            validate_routes(&[route("a"), route("a")]),
            Err(RouteError::DuplicateName("a".into()))
        );
    }
}
