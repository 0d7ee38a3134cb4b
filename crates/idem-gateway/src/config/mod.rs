//! Command-line flags, environment variables and the validated configuration.
//!
//! Every setting has one owner: the layer's ([`idem_http::Options`], with the
//! engine's defaults), the store's ([`StoreOptions`]) and the gateway's own
//! (this module's `DEFAULT_*` constants). [`GatewayConfig`] embeds the first
//! two; the flags ([`GatewayArgs`]) show the same defaults in `--help`.

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::time::Duration;

use http::{HeaderName, Method, Uri};
use idem_core::RedactedUrl;
use idem_core::MIN_LEASE;
use idem_http::{
    Options, ScopeBy, DEFAULT_MAX_BODY, DEFAULT_MAX_LIVE_TOKENS, DEFAULT_METHODS,
    DEFAULT_RETENTION_LIMIT, DEFAULT_TOKENS_PER_SCOPE, DEFAULT_TOKEN_TTL,
};
use idem_http::{DEFAULT_BODY_TIMEOUT, DEFAULT_MAX_BUFFERED};
pub use ipnet::IpNet;

use crate::store::StoreOptions;

pub mod file;
pub mod reload;

/// The listening address by default: `127.0.0.1:8000`.
pub const DEFAULT_LISTEN: SocketAddr = SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 8000));
/// The store by default: a SQLite file `idem.db` in the working directory.
pub const DEFAULT_STORE: &str = "sqlite://idem.db";
/// Time allowed for the upstream's response headers, and between two chunks
/// of its body, by default: 30 s.
pub const DEFAULT_UPSTREAM_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a pooled upstream connection may stay unused by default: 1 s.
pub const DEFAULT_UPSTREAM_IDLE_TIMEOUT: Duration = Duration::from_secs(1);
/// How often expired records are purged by default: every 60 s.
pub const DEFAULT_PURGE_INTERVAL: Duration = Duration::from_secs(60);
/// How long a graceful shutdown waits by default: 30 s.
pub const DEFAULT_SHUTDOWN_GRACE: Duration = Duration::from_secs(30);
/// How long a client connection may go without a complete request head by
/// default (from accept, or from the end of the previous response): 10 s.
pub const DEFAULT_HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// The admin listener's address by default: `127.0.0.1:9901` (loopback
/// only, as Envoy's admin interface is usually run).
pub const DEFAULT_ADMIN_LISTEN: SocketAddr =
    SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 9901));
/// Most client connections served at once by default: 10,000 (lowered to
/// what `RLIMIT_NOFILE` leaves, see [`GatewayConfig::max_connections`]).
pub const DEFAULT_MAX_CONNECTIONS: usize = 10_000;

/// Flags of `idem gateway`. Every flag can also be set by an environment
/// variable `IDEM_<FLAG>`; a flag on the command line wins over the variable.
///
/// Durations take a number and a unit (`500ms`, `30s`, `5m`, `24h`; see the
/// `humantime` crate), at most 100 years ([`MAX_DURATION`]); `0` is accepted for `--wait`. Byte sizes take a plain
/// number of bytes or a number with a suffix: `KB`/`MB`/`GB` (powers of 1000)
/// or `KiB`/`MiB`/`GiB` (powers of 1024), case-insensitive. The defaults
/// shown by `--help` are those of [`GatewayConfig::new`].
///
/// Parse with clap, then validate with [`GatewayArgs::into_config`]:
///
/// ```
/// use clap::Parser;
/// #[derive(Parser)]
/// struct Cli {
///     #[command(flatten)]
///     gateway: idem_gateway::GatewayArgs,
/// }
/// let cli = Cli::try_parse_from(["idem", "--upstream", "http://127.0.0.1:3000", "--store", "memory://"]).unwrap();
/// let config = cli.gateway.into_config().unwrap();
/// assert_eq!(config.listen.to_string(), "127.0.0.1:8000");
/// assert_eq!(config.layer.methods, vec![http::Method::POST, http::Method::PATCH]);
/// ```
#[derive(clap::Args, Clone, Debug)]
pub struct GatewayArgs {
    /// A configuration file (TOML 1.0, docs/CONFIG.md): every flag below by
    /// its long name with `-` written `_` (`upstream = "http://…"`,
    /// `scope_header = ["x-api-key"]`, `require_key = true`), and
    /// `[[routes]]` with per-route rules. Flags and IDEM_* variables win
    /// over the file. Reloaded on SIGHUP and when it changes.
    #[arg(long, env = "IDEM_CONFIG", value_name = "FILE")]
    pub config: Option<std::path::PathBuf>,

    /// Address to listen on, `IP:PORT`.
    #[arg(
        long,
        env = "IDEM_LISTEN",
        value_name = "ADDR",
        default_value_t = DEFAULT_LISTEN
    )]
    pub listen: SocketAddr,

    /// The service to protect, an `http://host[:port][/prefix]` or
    /// `https://host[:port][/prefix]` URL (default ports 80 and 443; an
    /// https upstream's certificate is checked against the host, see
    /// `--upstream-ca`). A path prefix is put in front of every request
    /// path. Required: here, in IDEM_UPSTREAM or in the configuration file.
    #[arg(long, env = "IDEM_UPSTREAM", value_name = "URL", value_parser = parse_upstream)]
    pub upstream: Option<Uri>,

    /// Where records live: `memory://` (lost on exit), `sqlite://relative.db`
    /// or `sqlite:///absolute/path.db` (created if missing),
    /// `postgres://user:pw@host:5432/db` (`postgresql://`),
    /// `mysql://user:pw@host:3306/db` (`mariadb://`), `redis://host:6379/`
    /// (`rediss://` for TLS, `redis+unix:///path.sock`),
    /// `redis+cluster://host:port,host:port` (`rediss+cluster://`). Gateway
    /// options go in the query: `idem_table`, `idem_schema`, `idem_migrate`
    /// (SQL), `idem_prefix` (Redis); other parameters are the driver's (e.g.
    /// PostgreSQL's `sslmode`).
    #[arg(
        long,
        env = "IDEM_STORE",
        value_name = "URL",
        default_value = DEFAULT_STORE
    )]
    pub store: RedactedUrl,

    /// How long a completed result is replayed.
    #[arg(long, env = "IDEM_TTL", value_name = "DURATION", default_value = show_duration(Options::default().ttl), value_parser = parse_duration)]
    pub ttl: Duration,

    /// How long a claim holds before another request may take the key over
    /// (renewed while the upstream call runs). At least 1s
    /// (`idem_core::MIN_LEASE`), longer than `--store-timeout`, and not
    /// longer than the TTL.
    #[arg(long, env = "IDEM_LEASE", value_name = "DURATION", default_value = show_duration(Options::default().lease), value_parser = parse_duration)]
    pub lease: Duration,

    /// Guarded methods, comma-separated, case-insensitive. Safe methods
    /// (GET, HEAD, OPTIONS, TRACE) and CONNECT are refused.
    #[arg(
        long,
        env = "IDEM_METHODS",
        value_name = "METHODS",
        default_value = DEFAULT_METHODS.map(|m| m.to_string()).join(","),
        value_delimiter = ',',
        value_parser = parse_method
    )]
    pub methods: Vec<Method>,

    /// Answer 400 to a guarded request that has no `Idempotency-Key`
    /// (default: let it through unguarded). The variable takes
    /// true/false, yes/no, on/off, 1/0.
    #[arg(
        long,
        env = "IDEM_REQUIRE_KEY",
        action = clap::ArgAction::SetTrue,
        value_parser = clap::builder::BoolishValueParser::new()
    )]
    pub require_key: bool,

    /// Also log requests that are not guarded (other methods, guarded ones
    /// without a key): one line each, target `idem`, message `request`,
    /// with `outcome=passthrough`, status, duration, method and the
    /// normalised path. Guarded requests always get their line. The
    /// variable takes true/false, yes/no, on/off, 1/0.
    #[arg(
        long,
        env = "IDEM_ACCESS_LOG",
        action = clap::ArgAction::SetTrue,
        value_parser = clap::builder::BoolishValueParser::new()
    )]
    pub access_log: bool,

    /// Largest body of a guarded request, bytes (413 beyond).
    #[arg(long, env = "IDEM_MAX_BODY", value_name = "BYTES", default_value = show_size(DEFAULT_MAX_BODY), value_parser = parse_size)]
    pub max_body: usize,

    /// Largest response body kept for replay, bytes. A larger response still
    /// reaches its first caller; duplicates get an error instead of a rerun.
    #[arg(long, env = "IDEM_RETENTION_LIMIT", value_name = "BYTES", default_value = show_size(DEFAULT_RETENTION_LIMIT), value_parser = parse_size)]
    pub retention_limit: usize,

    /// How long to wait for the upstream's response headers, and then for
    /// each next chunk of its response body (an idle timeout between
    /// chunks, not a bound on the whole body). Headers late: 504; a body
    /// that stalls: 502 `upstream-failed` (or, past `--retention-limit`,
    /// the response cut short). Either way the key stays in flight until
    /// its lease ends. Must be above 0.
    #[arg(long, env = "IDEM_UPSTREAM_TIMEOUT", value_name = "DURATION", default_value = show_duration(DEFAULT_UPSTREAM_TIMEOUT), value_parser = parse_duration)]
    pub upstream_timeout: Duration,

    /// How long a pooled keep-alive connection to the upstream may stay
    /// unused before it is closed instead of reused. Keep it below the
    /// upstream's own keep-alive timeout (Node.js 5s, gunicorn 2s): a
    /// request sent on a connection the upstream is closing fails with an
    /// unknown outcome (502, key held until its lease ends). Must be above 0.
    #[arg(long, env = "IDEM_UPSTREAM_IDLE_TIMEOUT", value_name = "DURATION", default_value = show_duration(DEFAULT_UPSTREAM_IDLE_TIMEOUT), value_parser = parse_duration)]
    pub upstream_idle_timeout: Duration,

    /// How long a duplicate waits for an in-flight original to finish and
    /// then gets its replay; `0` answers 409 at once.
    #[arg(long, env = "IDEM_WAIT", value_name = "DURATION", default_value = show_duration(Options::default().wait), value_parser = parse_duration)]
    pub wait: Duration,

    /// How long the answer of a released failure (a 5xx, 502
    /// `upstream-unreachable`; a body within `--retention-limit`) is kept,
    /// with `Retry-After`, for the duplicates that waited for it (`--wait`,
    /// on any instance): they get it replayed instead of each running the
    /// request again in turn. A later retry, one that did not wait for that
    /// execution (a client's own quick retry too), is not given the
    /// failure: it waits out the window, at most twice this long, and runs
    /// again. `0` releases the key at once.
    #[arg(long, env = "IDEM_SHARE_FAILURE", value_name = "DURATION", default_value = show_duration(Options::default().share_failure), value_parser = parse_duration)]
    pub share_failure: Duration,

    /// How long a key whose outcome is unknown (the upstream timed out:
    /// 504; its response body broke; the result could not be saved) stays
    /// held — duplicates get 409, another request with the key 422 — before
    /// a retry may run it again. `0` (the default) holds it until its lease
    /// ends. A held key shows as `held` in `idem keys` and is settled by
    /// an operator with `idem keys delete` (release: the next request runs)
    /// or `idem keys complete` (store the answer duplicates get).
    #[arg(long, env = "IDEM_HOLD_FOR", value_name = "DURATION", default_value = show_duration(Options::default().hold_for), value_parser = parse_duration)]
    pub hold_for: Duration,

    /// Most pooled connections to a PostgreSQL or MySQL store (SQLite and
    /// Redis ignore it). Several gateway instances each open this many.
    #[arg(
        long,
        env = "IDEM_STORE_POOL_SIZE",
        value_name = "N",
        default_value_t = StoreOptions::default().pool_size
    )]
    pub store_pool_size: u32,

    /// The longest one store call may take, including the wait for a
    /// pooled connection; also the connect timeout at startup. A call cut
    /// off answers 503 before the upstream is called, or — while saving a
    /// result — leaves the key in flight until its lease ends.
    #[arg(long, env = "IDEM_STORE_TIMEOUT", value_name = "DURATION", default_value = show_duration(StoreOptions::default().timeout), value_parser = parse_duration)]
    pub store_timeout: Duration,

    /// DANGEROUS: when the store cannot be reached as a request arrives,
    /// forward it to the upstream WITHOUT idempotency protection (marked
    /// `Idempotency-Status: unprotected`) instead of answering 503. A
    /// retried request can then run twice (double charge). Off by default
    /// (fail closed). The variable takes true/false, yes/no, on/off, 1/0.
    #[arg(
        long,
        env = "IDEM_FAIL_OPEN",
        action = clap::ArgAction::SetTrue,
        value_parser = clap::builder::BoolishValueParser::new()
    )]
    pub fail_open: bool,

    /// Request headers that identify the caller: a key is scoped by the
    /// SHA-256 over these headers' names and values (every field, in the
    /// order given), so two callers that send the same key never share a
    /// record. Repeat the flag or separate names by commas
    /// (`--scope-header x-api-key,x-tenant`); case-insensitive. A request
    /// carrying none of them falls into one shared anonymous scope.
    /// `Idempotency-Key` and hop-by-hop fields are refused.
    #[arg(
        long = "scope-header",
        env = "IDEM_SCOPE_HEADER",
        value_name = "NAME",
        default_value = show_scope(&ScopeBy::default()),
        value_delimiter = ','
    )]
    pub scope_header: Vec<String>,

    /// How long a submit token from `POST /_idem/tokens` may be used for a
    /// first submit. Above 0; capped at `--ttl` (a result must outlive its
    /// token).
    #[arg(long, env = "IDEM_TOKEN_TTL", value_name = "DURATION", default_value = show_duration(DEFAULT_TOKEN_TTL), value_parser = parse_duration)]
    pub token_ttl: Duration,

    /// Guarded requests whose path starts with this prefix (by path
    /// segment: `/pay` covers `/pay/42`, not `/payment`) must carry a live
    /// submit token from `POST /_idem/tokens` as their `Idempotency-Key`:
    /// without one 428, with an unknown, expired or other caller's token
    /// 403; the upstream is not called. Repeat the flag or separate
    /// prefixes by commas.
    #[arg(
        long = "require-token",
        env = "IDEM_REQUIRE_TOKEN",
        value_name = "PATH_PREFIX",
        value_delimiter = ','
    )]
    pub require_token: Vec<String>,

    /// Serve `POST /_idem/tokens` even without a `--require-token` route
    /// (e.g. for tokens the upstream checks itself). Without either the
    /// endpoint answers 404. The variable takes true/false, yes/no, on/off,
    /// 1/0.
    #[arg(
        long,
        env = "IDEM_ISSUE_TOKENS",
        action = clap::ArgAction::SetTrue,
        value_parser = clap::builder::BoolishValueParser::new()
    )]
    pub issue_tokens: bool,

    /// Issue submit tokens to callers that send none of the `--scope-header`
    /// headers (default: 400 `scope-required`). They all share one
    /// anonymous scope, and so one `--tokens-per-scope` budget. The variable
    /// takes true/false, yes/no, on/off, 1/0.
    #[arg(
        long,
        env = "IDEM_ANONYMOUS_TOKENS",
        action = clap::ArgAction::SetTrue,
        value_parser = clap::builder::BoolishValueParser::new()
    )]
    pub anonymous_tokens: bool,

    /// Most live submit tokens (issued, not yet used, not expired) per
    /// caller scope; beyond it `POST /_idem/tokens` answers 429
    /// `too-many-tokens` with `Retry-After`. Counted per gateway instance.
    /// Above 0.
    #[arg(long, env = "IDEM_TOKENS_PER_SCOPE", value_name = "N", default_value_t = DEFAULT_TOKENS_PER_SCOPE)]
    pub tokens_per_scope: usize,

    /// Most live submit tokens in all, per gateway instance (each is a
    /// record in the store until used or expired); beyond it 429
    /// `too-many-tokens`. With `memory://` at most half its
    /// `idem_max_records`, so tokens cannot crowd out results. Above 0.
    #[arg(long, env = "IDEM_MAX_LIVE_TOKENS", value_name = "N", default_value_t = DEFAULT_MAX_LIVE_TOKENS)]
    pub max_live_tokens: usize,

    /// How often the gateway deletes expired records (completed ones past
    /// `--ttl`, claims past their lease) from the store, in the background;
    /// the first purge runs one interval after startup. Expired records are
    /// never replayed, purged or not: this only bounds how long they take
    /// up room. Must be above 0.
    #[arg(long, env = "IDEM_PURGE_INTERVAL", value_name = "DURATION", default_value = show_duration(DEFAULT_PURGE_INTERVAL), value_parser = parse_duration)]
    pub purge_interval: Duration,

    /// Addresses of proxies in front of the gateway whose `X-Forwarded-For`,
    /// `X-Forwarded-Host`, `X-Forwarded-Proto` and `Forwarded` (RFC 7239)
    /// fields are trusted: kept and appended to. From any other peer those
    /// fields are dropped and replaced by the gateway's own. A CIDR
    /// (`10.0.0.0/8`, `fd00::/8`) or one address; repeat the flag or
    /// separate them by commas. Default: none (every client's fields are
    /// replaced).
    #[arg(
        long = "trusted-proxy",
        env = "IDEM_TRUSTED_PROXIES",
        value_name = "CIDR",
        value_delimiter = ',',
        value_parser = parse_trusted_proxy
    )]
    pub trusted_proxy: Vec<IpNet>,
    /// How long a client connection may go without a complete request
    /// head: from accept to the end of the first request's headers, and
    /// from the end of each response to the end of the next request's
    /// headers (the keep-alive idle time). A socket that sends nothing,
    /// or a header that trickles, is closed then; HTTP/1.1 and HTTP/2
    /// alike (an HTTP/2 connection with no stream open is closed after
    /// it, pings or not). Must be above 0.
    #[arg(long, env = "IDEM_HEADER_TIMEOUT", value_name = "DURATION", default_value = show_duration(DEFAULT_HEADER_TIMEOUT), value_parser = parse_duration)]
    pub header_timeout: Duration,

    /// The longest reading a guarded request's body may take in all (a
    /// total deadline, not an idle one). Past it: 408 `body-timeout`, the
    /// key untouched, the bytes freed. Must be above 0.
    #[arg(long, env = "IDEM_BODY_TIMEOUT", value_name = "DURATION", default_value = show_duration(DEFAULT_BODY_TIMEOUT), value_parser = parse_duration)]
    pub body_timeout: Duration,

    /// Most client connections served at once; past it the gateway stops
    /// accepting until one closes (new connections wait in the kernel's
    /// backlog). Lowered at start to what the file-descriptor limit
    /// (`ulimit -n`) leaves: (limit − store pool size − 32) / 2, one
    /// upstream connection counted per client connection. A limit that
    /// leaves no room is refused at start. Must be above 0.
    #[arg(long, env = "IDEM_MAX_CONNECTIONS", value_name = "N", default_value_t = DEFAULT_MAX_CONNECTIONS)]
    pub max_connections: usize,

    /// Most bytes of guarded request bodies held in memory at once, across
    /// all requests. A request whose declared length does not fit gets 503
    /// `overloaded` with `Retry-After` before its body is read (a chunked
    /// body: as soon as a chunk does not fit). At least `--max-body`.
    #[arg(long, env = "IDEM_MAX_BUFFERED", value_name = "BYTES", default_value = show_size(DEFAULT_MAX_BUFFERED), value_parser = parse_size)]
    pub max_buffered: usize,

    /// Address of the admin listener (`/metrics`, health probes, and with
    /// `--admin-token-file` the key administration API and the status
    /// page), `IP:PORT`, or `off`. Keep it off the clients' network.
    #[arg(long, env = "IDEM_ADMIN_LISTEN", value_name = "ADDR|off", default_value = AdminListen::default().to_string(), value_parser = parse_admin_listen)]
    pub admin_listen: AdminListen,

    /// A file holding the admin API's bearer token (at least 16 visible
    /// ASCII characters; trailing whitespace is ignored). Without it the
    /// admin listener serves only `/metrics` and the health probes.
    #[arg(long, env = "IDEM_ADMIN_TOKEN_FILE", value_name = "FILE")]
    pub admin_token_file: Option<std::path::PathBuf>,

    /// Export traces over OTLP/HTTP (protobuf) to this collector, given as
    /// its base URL like OTEL_EXPORTER_OTLP_ENDPOINT (`/v1/traces` is
    /// appended, e.g. http://127.0.0.1:4318). Service name:
    /// OTEL_SERVICE_NAME, default `idem-gateway`. Unset: no export.
    #[arg(long, env = "IDEM_OTLP_ENDPOINT", value_name = "URL", value_parser = crate::otel::parse_otlp_endpoint)]
    pub otlp_endpoint: Option<crate::otel::OtlpEndpoint>,

    /// Serve TLS on `--listen`: the certificate chain, PEM (leaf first).
    /// Needs `--tls-key`. Reloaded without a restart when the file changes
    /// and on SIGHUP; a reload that fails keeps the old certificate. ALPN
    /// offers `h2` and `http/1.1`. Unset: plain HTTP.
    #[arg(long, env = "IDEM_TLS_CERT", value_name = "FILE", requires = "tls_key")]
    pub tls_cert: Option<std::path::PathBuf>,

    /// The private key of `--tls-cert`, PEM (PKCS#8, PKCS#1 or SEC1).
    #[arg(long, env = "IDEM_TLS_KEY", value_name = "FILE", requires = "tls_cert")]
    pub tls_key: Option<std::path::PathBuf>,

    /// Require a client certificate signed by one of these CAs (PEM) on the
    /// TLS listener (mTLS): a connection without one, or with an expired or
    /// foreign one, fails its handshake. Needs `--tls-cert`.
    #[arg(
        long,
        env = "IDEM_TLS_CLIENT_CA",
        value_name = "FILE",
        requires = "tls_cert"
    )]
    pub tls_client_ca: Option<std::path::PathBuf>,

    /// What scopes a key: `headers` (the `--scope-header` values) or
    /// `client-cert` (the SHA-256 of the verified client certificate, so
    /// mTLS callers are scoped by identity; needs `--tls-client-ca`).
    #[arg(long, env = "IDEM_SCOPE_FROM", value_name = "headers|client-cert", default_value = "headers", value_parser = parse_scope_from)]
    pub scope_from: ScopeFrom,

    /// Trust this CA (PEM) for an `https://` upstream instead of the
    /// system's roots. The certificate is always checked against the URL's
    /// host (SNI and name), as RFC 9110 §4.3.4 requires.
    #[arg(long, env = "IDEM_UPSTREAM_CA", value_name = "FILE")]
    pub upstream_ca: Option<std::path::PathBuf>,

    /// A client certificate chain (PEM) shown to an `https://` upstream that
    /// asks for one (mTLS). Needs `--upstream-client-key`.
    #[arg(
        long,
        env = "IDEM_UPSTREAM_CLIENT_CERT",
        value_name = "FILE",
        requires = "upstream_client_key"
    )]
    pub upstream_client_cert: Option<std::path::PathBuf>,

    /// The private key of `--upstream-client-cert`, PEM.
    #[arg(
        long,
        env = "IDEM_UPSTREAM_CLIENT_KEY",
        value_name = "FILE",
        requires = "upstream_client_cert"
    )]
    pub upstream_client_key: Option<std::path::PathBuf>,

    /// Speak HTTP/2 to the upstream: with prior knowledge (h2c) to an
    /// `http://` upstream; over TLS, only h2 is offered in ALPN (an upstream
    /// that does not select it is unreachable). Needed for gRPC services.
    /// Default: HTTP/1.1 only (over TLS, ALPN offers only http/1.1, so
    /// protocol upgrades such as WebSocket keep working). The variable takes
    /// true/false, yes/no, on/off, 1/0.
    #[arg(
        long,
        env = "IDEM_UPSTREAM_HTTP2",
        action = clap::ArgAction::SetTrue,
        value_parser = clap::builder::FalseyValueParser::new()
    )]
    pub upstream_http2: bool,
}

/// Where the admin listener listens: an address, or nowhere.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AdminListen {
    /// No admin listener (`off`).
    Off,
    /// Listen on this `IP:PORT`.
    On(SocketAddr),
}

impl Default for AdminListen {
    /// [`DEFAULT_ADMIN_LISTEN`].
    fn default() -> Self {
        Self::On(DEFAULT_ADMIN_LISTEN)
    }
}

impl AdminListen {
    /// The address, unless off.
    pub fn addr(self) -> Option<SocketAddr> {
        match self {
            Self::Off => None,
            Self::On(a) => Some(a),
        }
    }
}

impl std::fmt::Display for AdminListen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Off => f.write_str("off"),
            Self::On(a) => write!(f, "{a}"),
        }
    }
}

/// Parses `--admin-listen`: `off` (any case) or `IP:PORT`.
///
/// # Errors
/// A message for anything else.
pub fn parse_admin_listen(raw: &str) -> Result<AdminListen, String> {
    if raw.trim().eq_ignore_ascii_case("off") {
        return Ok(AdminListen::Off);
    }
    raw.trim()
        .parse()
        .map(AdminListen::On)
        .map_err(|_| format!("{raw:?} is neither `off` nor an IP:PORT address"))
}

impl GatewayArgs {
    /// Validates the flags together and builds the configuration.
    ///
    /// # Errors
    /// [`ConfigError`] when the lease is 0, the TTL is shorter than the
    /// lease, the upstream timeout, the upstream idle timeout, the body
    /// limit, the store pool size, the store timeout or the purge interval
    /// is 0, no method is given, the store URL names an unsupported scheme
    /// or a bad `idem_*` option, or a `--scope-header` name is not a usable
    /// header name ([`ConfigError::ScopeHeader`]), the token TTL is 0, or a
    /// `--require-token` prefix does not start with `/`
    /// ([`ConfigError::RequireToken`]), or no upstream is given
    /// ([`ConfigError::NoUpstream`]).
    pub fn into_config(self) -> Result<GatewayConfig, ConfigError> {
        let upstream = self.upstream.clone().ok_or(ConfigError::NoUpstream)?;
        let mut names: Vec<HeaderName> = Vec::with_capacity(self.scope_header.len());
        for raw in &self.scope_header {
            let name = parse_scope_header(raw).map_err(ConfigError::ScopeHeader)?;
            // A name given twice would only hash its values twice.
            if !names.contains(&name) {
                names.push(name);
            }
        }
        let mut require_token = Vec::new();
        for raw in self.require_token {
            let prefix = parse_token_prefix(&raw).map_err(ConfigError::RequireToken)?;
            if !require_token.contains(&prefix) {
                require_token.push(prefix);
            }
        }
        let scope = match self.scope_from {
            ScopeFrom::Headers => ScopeBy::Headers(names),
            ScopeFrom::ClientCert if names == [http::header::AUTHORIZATION] => ScopeBy::ClientCert,
            ScopeFrom::ClientCert => {
                return Err(ConfigError::ScopeFrom(
                    "client-cert scopes every request by its TLS client certificate; \
                     --scope-header (or `scope_header`) would be ignored: leave it out"
                        .into(),
                ))
            }
        };
        let mut config = GatewayConfig::new(upstream);
        config.listen = self.listen;
        config.store = self.store;
        config.store_options.pool_size = self.store_pool_size;
        config.store_options.timeout = self.store_timeout;
        config.layer = Options {
            methods: self.methods,
            require_key: self.require_key,
            scope,
            max_body: self.max_body,
            retention_limit: self.retention_limit,
            lease: self.lease,
            ttl: self.ttl,
            wait: self.wait,
            share_failure: self.share_failure,
            hold_for: self.hold_for,
            require_token,
            // A result must outlive its token: the token TTL is capped at the TTL.
            token_ttl: self.token_ttl.min(self.ttl),
            anonymous_tokens: self.anonymous_tokens,
            tokens_per_scope: self.tokens_per_scope,
            max_live_tokens: self.max_live_tokens,
            body_timeout: self.body_timeout,
            max_buffered: self.max_buffered,
            access_log: self.access_log,
            ..config.layer
        };
        config.issue_tokens = self.issue_tokens;
        config.header_timeout = self.header_timeout;
        config.max_connections = self.max_connections;
        config.upstream_timeout = self.upstream_timeout;
        config.upstream_idle_timeout = self.upstream_idle_timeout;
        config.fail_open = self.fail_open;
        config.purge_interval = self.purge_interval;
        config.trusted_proxies = self.trusted_proxy;
        config.admin_listen = self.admin_listen;
        config.admin_token_file = self.admin_token_file;
        config.tls = self
            .tls_cert
            .zip(self.tls_key)
            .map(|(cert, key)| crate::tls::ListenerTls {
                cert,
                key,
                client_ca: self.tls_client_ca,
            });
        config.scope_from = self.scope_from;
        config.upstream_tls = crate::tls::UpstreamTls {
            ca: self.upstream_ca,
            client_cert: self.upstream_client_cert,
            client_key: self.upstream_client_key,
        };
        config.upstream_http2 = self.upstream_http2;
        config.validate()?;
        Ok(config)
    }
}

/// The gateway's validated settings: the layer's ([`Self::layer`]), the
/// store's ([`Self::store_options`]) and the gateway's own. Build one with
/// [`GatewayArgs::into_config`] or [`GatewayConfig::new`] (defaults as the
/// flags') and adjust its fields; [`crate::Gateway::bind`] validates it
/// again.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct GatewayConfig {
    /// Listening address (default [`DEFAULT_LISTEN`], `127.0.0.1:8000`;
    /// port 0 picks a free port, see [`crate::Gateway::local_addr`]).
    pub listen: SocketAddr,
    /// The upstream, `http://host[:port][/prefix]` or
    /// `https://host[:port][/prefix]` ([`parse_upstream`]).
    pub upstream: Uri,
    /// Store URL (default [`DEFAULT_STORE`], `sqlite://idem.db`), see
    /// [`crate::open_store`]; shown with its password as `***`.
    pub store: RedactedUrl,
    /// How the store is opened and how long one call may take (`--store-*`:
    /// pool size 16, timeout 5 s by default).
    pub store_options: StoreOptions,
    /// The idempotency layer's settings (`--ttl`, `--lease`, `--wait`,
    /// `--methods`, `--require-key`, `--max-body`, `--retention-limit`,
    /// `--scope-header`, `--token-ttl`, `--require-token`), defaults as
    /// [`Options::default`]. [`GatewayConfig::validate`] refuses an empty
    /// `ScopeBy::Headers` list and names [`parse_scope_header`] refuses;
    /// its `fail_open` guard is set by the gateway from [`Self::fail_open`].
    pub layer: Options,
    /// Time allowed for the upstream's response headers, and then between
    /// two chunks of its response body (default
    /// [`DEFAULT_UPSTREAM_TIMEOUT`], 30 s; above 0).
    pub upstream_timeout: Duration,
    /// How long a pooled keep-alive connection to the upstream may stay
    /// unused before it is closed rather than reused (default
    /// [`DEFAULT_UPSTREAM_IDLE_TIMEOUT`], 1 s; above 0). Keep it below the
    /// upstream's own keep-alive timeout.
    pub upstream_idle_timeout: Duration,
    /// Forward requests unprotected when the store cannot be reached at
    /// `begin` (default false: answer 503). See the crate docs before
    /// turning it on.
    pub fail_open: bool,
    /// How often expired records are purged (default
    /// [`DEFAULT_PURGE_INTERVAL`], 60 s; above 0; `--purge-interval`).
    pub purge_interval: Duration,
    /// How long a graceful shutdown waits, in all, for in-flight requests
    /// and for the runs of guarded requests whose clients already left,
    /// before it gives up on them (default [`DEFAULT_SHUTDOWN_GRACE`],
    /// 30 s). Not a flag.
    pub shutdown_grace: Duration,
    /// Peers whose forwarding fields (`X-Forwarded-For`, `-Host`,
    /// `-Proto`, `Forwarded`) are kept and appended to; from every other
    /// peer they are replaced (`--trusted-proxy`, default none). An
    /// IPv4-mapped IPv6 peer is matched as its IPv4 address.
    pub trusted_proxies: Vec<IpNet>,
    /// Serve `POST /_idem/tokens` even when `layer.require_token` is empty
    /// (default false; `--issue-tokens`). See [`GatewayConfig::tokens_served`].
    pub issue_tokens: bool,
    /// How long a client connection may go without a complete request
    /// head, from accept or from the end of the previous response (default
    /// [`DEFAULT_HEADER_TIMEOUT`], 10 s; above 0; `--header-timeout`).
    /// Applies to HTTP/1.1 (hyper's header read timeout as well) and to
    /// HTTP/2 (a connection with no stream open is closed after it).
    pub header_timeout: Duration,
    /// Most client connections served at once (default
    /// [`DEFAULT_MAX_CONNECTIONS`]; above 0; `--max-connections`). The cap
    /// in force is the smaller of this and `(RLIMIT_NOFILE − pool size −
    /// 32) / 2`, read by [`GatewayConfig::validate`]; past it the gateway
    /// stops accepting until a connection closes (nginx's behaviour when
    /// `worker_connections` are used up), and guarded or proxied requests
    /// in flight are capped at the same number (HTTP/2 streams wait).
    pub max_connections: usize,
    /// The admin listener (default [`DEFAULT_ADMIN_LISTEN`];
    /// `--admin-listen`). See the `admin` section of the crate docs.
    pub admin_listen: AdminListen,
    /// The admin API's bearer token file (default none: the admin API and
    /// the status page answer 404; `--admin-token-file`). Read by
    /// [`crate::Gateway::bind`].
    pub admin_token_file: Option<std::path::PathBuf>,
    /// Per-route rules, first match wins (default none: every request
    /// gets [`Self::layer`]); from the configuration file's `[[routes]]`.
    /// [`GatewayConfig::validate`] checks each guarded route as the
    /// top-level settings: lease at least 1 s and above the store timeout,
    /// TTL at least the lease (and the token TTL with `require_token`),
    /// `max_body` above 0 and within `max_buffered`, no safe method.
    pub routes: Vec<idem_http::Route>,
    /// The configuration file this came from and the command line it was
    /// layered under (set by [`file::load`]): the gateway
    /// reloads the routes and the per-request settings from it on SIGHUP
    /// and when the file changes (see [`reload`]). Default none.
    pub config_source: Option<file::ConfigSource>,
    /// TLS on the listener (`--tls-cert`, `--tls-key`, `--tls-client-ca`);
    /// default none: plain HTTP.
    pub tls: Option<crate::tls::ListenerTls>,
    /// What scopes a key (`--scope-from`, default [`ScopeFrom::Headers`]).
    /// [`ScopeFrom::ClientCert`] needs [`Self::tls`] with a client CA.
    pub scope_from: ScopeFrom,
    /// How an `https://` upstream is trusted and what it is shown
    /// (`--upstream-ca`, `--upstream-client-cert/-key`); default: the
    /// system's roots, no client certificate.
    pub upstream_tls: crate::tls::UpstreamTls,
    /// HTTP/2 to the upstream (`--upstream-http2`; default false: HTTP/1.1).
    pub upstream_http2: bool,
}

/// What scopes a key (`--scope-from`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ScopeFrom {
    /// The `--scope-header` headers' values (the default).
    #[default]
    Headers,
    /// The verified TLS client certificate (SHA-256 of its DER bytes).
    ClientCert,
}

impl std::fmt::Display for ScopeFrom {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ScopeFrom::Headers => "headers",
            ScopeFrom::ClientCert => "client-cert",
        })
    }
}

/// Parses `--scope-from`: `headers` or `client-cert`.
///
/// # Errors
/// A message naming the two accepted values.
pub fn parse_scope_from(raw: &str) -> Result<ScopeFrom, String> {
    match raw.trim().to_ascii_lowercase().as_str() {
        "headers" => Ok(ScopeFrom::Headers),
        "client-cert" => Ok(ScopeFrom::ClientCert),
        other => Err(format!("{other:?}: expected `headers` or `client-cert`")),
    }
}

impl GatewayConfig {
    /// A configuration for `upstream` with every other setting at its default.
    pub fn new(upstream: Uri) -> Self {
        Self {
            listen: DEFAULT_LISTEN,
            upstream,
            store: DEFAULT_STORE.into(),
            store_options: StoreOptions::default(),
            layer: Options::default(),
            upstream_timeout: DEFAULT_UPSTREAM_TIMEOUT,
            upstream_idle_timeout: DEFAULT_UPSTREAM_IDLE_TIMEOUT,
            fail_open: false,
            purge_interval: DEFAULT_PURGE_INTERVAL,
            shutdown_grace: DEFAULT_SHUTDOWN_GRACE,
            trusted_proxies: Vec::new(),
            issue_tokens: false,
            header_timeout: DEFAULT_HEADER_TIMEOUT,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            admin_listen: AdminListen::default(),
            admin_token_file: None,
            routes: Vec::new(),
            config_source: None,
            tls: None,
            scope_from: ScopeFrom::Headers,
            upstream_tls: crate::tls::UpstreamTls::default(),
            upstream_http2: false,
        }
    }

    /// Whether `POST /_idem/tokens` is served: with a `--require-token`
    /// prefix, a route with `require_token = true`, or `--issue-tokens`;
    /// otherwise it answers 404.
    pub fn tokens_served(&self) -> bool {
        self.issue_tokens
            || !self.layer.require_token.is_empty()
            || self.routes.iter().any(|r| r.guard && r.require_token)
    }

    /// The connection limit in force: [`Self::max_connections`], lowered
    /// to what this process's `RLIMIT_NOFILE` leaves (read now).
    ///
    /// # Errors
    /// [`ConfigError::Zero`] for a zero header timeout, body timeout,
    /// connection cap or body budget, [`ConfigError::BufferedBelowMaxBody`],
    /// [`ConfigError::NoRoomForConnections`].
    pub(crate) fn connection_cap(&self) -> Result<crate::limits::ConnectionCap, ConfigError> {
        if self.header_timeout.is_zero() {
            return Err(ConfigError::Zero("--header-timeout"));
        }
        if self.layer.body_timeout.is_zero() {
            return Err(ConfigError::Zero("--body-timeout"));
        }
        if self.max_connections == 0 {
            return Err(ConfigError::Zero("--max-connections"));
        }
        if self.layer.max_buffered < self.layer.max_body {
            return Err(ConfigError::BufferedBelowMaxBody {
                max_buffered: self.layer.max_buffered,
                max_body: self.layer.max_body,
            });
        }
        crate::limits::connection_cap(
            self.max_connections,
            self.store_options.pool_size,
            crate::limits::nofile(),
        )
        .map_err(|crate::limits::NoRoom { nofile, reserve }| {
            ConfigError::NoRoomForConnections { nofile, reserve }
        })
    }

    /// Checks the TLS settings of the upstream: `--upstream-ca` and
    /// `--upstream-client-cert/-key` only for an `https://` upstream (for an
    /// `http://` one they would do nothing while seeming to protect it), the
    /// client certificate and key both or neither, and, for an `https://`
    /// upstream, that its TLS configuration can be built from the files
    /// (each is read and parsed now; the system roots are loaded when no
    /// CA is named).
    ///
    /// # Errors
    /// [`ConfigError::UpstreamTlsSettings`] or [`ConfigError::UpstreamTls`].
    fn check_upstream_tls(&self) -> Result<(), ConfigError> {
        let tls = &self.upstream_tls;
        if tls.client_cert.is_some() != tls.client_key.is_some() {
            return Err(ConfigError::UpstreamTlsSettings(
                "--upstream-client-cert and --upstream-client-key go together: give both or neither"
                    .into(),
            ));
        }
        if self.upstream.scheme() != Some(&http::uri::Scheme::HTTPS) {
            if let Some(flag) = [
                (tls.ca.is_some(), "--upstream-ca"),
                (tls.client_cert.is_some(), "--upstream-client-cert"),
            ]
            .into_iter()
            .find_map(|(set, flag)| set.then_some(flag))
            {
                return Err(ConfigError::UpstreamTlsSettings(format!(
                    "{flag} applies to an https:// upstream only, and --upstream is {};                      use an https:// URL or drop {flag}",
                    self.upstream
                )));
            }
            return Ok(());
        }
        crate::tls::upstream::client_config(tls, self.upstream_http2)
            .map(drop)
            .map_err(ConfigError::UpstreamTls)
    }

    /// Checks the settings together.
    ///
    /// # Errors
    /// The first problem found, as a [`ConfigError`].
    pub fn validate(&self) -> Result<(), ConfigError> {
        let layer = &self.layer;
        parse_upstream(&self.upstream.to_string()).map_err(ConfigError::Upstream)?;
        self.check_upstream_tls()?;
        if layer.lease < MIN_LEASE {
            return Err(ConfigError::LeaseTooShort { lease: layer.lease });
        }
        if layer.ttl < layer.lease {
            return Err(ConfigError::TtlShorterThanLease {
                ttl: layer.ttl,
                lease: layer.lease,
            });
        }
        if !self.store_options.timeout.is_zero() && layer.lease <= self.store_options.timeout {
            return Err(ConfigError::LeaseNotAboveStoreTimeout {
                lease: layer.lease,
                store_timeout: self.store_options.timeout,
            });
        }
        if layer.share_failure > idem_core::MAX_SHARE_FAILURE {
            return Err(ConfigError::ShareFailureTooLong {
                share_failure: layer.share_failure,
            });
        }
        if self.upstream_timeout.is_zero() {
            return Err(ConfigError::Zero("--upstream-timeout"));
        }
        if self.upstream_idle_timeout.is_zero() {
            return Err(ConfigError::Zero("--upstream-idle-timeout"));
        }
        if layer.max_body == 0 {
            return Err(ConfigError::Zero("--max-body"));
        }
        if self.store_options.pool_size == 0 {
            return Err(ConfigError::Zero("--store-pool-size"));
        }
        if self.store_options.timeout.is_zero() {
            return Err(ConfigError::Zero("--store-timeout"));
        }
        if self.purge_interval.is_zero() {
            return Err(ConfigError::Zero("--purge-interval"));
        }
        if layer.methods.is_empty() {
            return Err(ConfigError::NoMethods);
        }
        if layer.token_ttl.is_zero() {
            return Err(ConfigError::Zero("--token-ttl"));
        }
        if layer.tokens_per_scope == 0 {
            return Err(ConfigError::Zero("--tokens-per-scope"));
        }
        if layer.max_live_tokens == 0 {
            return Err(ConfigError::Zero("--max-live-tokens"));
        }
        if self.tokens_served() {
            if let Some(records) = crate::store::memory_max_records(self.store.expose()) {
                if layer.max_live_tokens > records / 2 {
                    return Err(ConfigError::TokensCrowdOutResults {
                        max_live_tokens: layer.max_live_tokens,
                        max_records: records,
                    });
                }
            }
        }
        self.connection_cap()?;
        for prefix in &layer.require_token {
            parse_token_prefix(prefix).map_err(ConfigError::RequireToken)?;
        }
        for m in &layer.methods {
            check_method(m).map_err(ConfigError::Method)?;
        }
        crate::store::StoreKind::of_url(self.store.expose()).map_err(ConfigError::Store)?;
        if let ScopeBy::Headers(names) = &layer.scope {
            if names.is_empty() {
                return Err(ConfigError::ScopeHeader(
                    "no header named; every caller would share one scope \
                     (use ScopeBy::Fixed for that on purpose)"
                        .into(),
                ));
            }
            for name in names {
                check_scope_header(name).map_err(ConfigError::ScopeHeader)?;
            }
        }
        self.validate_scope_from()?;
        idem_http::routes::validate_routes(&self.routes).map_err(ConfigError::Route)?;
        for route in self.routes.iter().filter(|r| r.guard) {
            self.validate_route(route).map_err(|reason| {
                ConfigError::Route(idem_http::RouteError::Invalid {
                    route: route.name.clone(),
                    reason,
                })
            })?;
        }
        Ok(())
    }

    /// `--scope-from client-cert` needs `--tls-client-ca`, and then scopes
    /// the layer and every route by the client certificate (a route cannot
    /// fall back to headers); `layer.scope` says the same as `scope_from`.
    fn validate_scope_from(&self) -> Result<(), ConfigError> {
        let by_cert = self.scope_from == ScopeFrom::ClientCert;
        if by_cert != (self.layer.scope == ScopeBy::ClientCert) {
            return Err(ConfigError::ScopeFrom(format!(
                "scope_from is {} but layer.scope is {}; set both to client-cert \
                 (ScopeFrom::ClientCert with ScopeBy::ClientCert) or neither",
                self.scope_from,
                show_scope(&self.layer.scope)
            )));
        }
        if by_cert && self.tls.as_ref().is_none_or(|t| t.client_ca.is_none()) {
            return Err(ConfigError::ScopeFrom(
                "client-cert needs --tls-client-ca (and --tls-cert/--tls-key): without \
                 verified client certificates no request could be scoped"
                    .into(),
            ));
        }
        Ok(())
    }

    /// The gateway's checks of one guarded route, as of the top level.
    fn validate_route(&self, route: &idem_http::Route) -> Result<(), String> {
        let o = &route.options;
        if (self.scope_from == ScopeFrom::ClientCert) != (o.scope == ScopeBy::ClientCert) {
            return Err(format!(
                "scoped by {} while the gateway runs with --scope-from {}; under client-cert \
                 a route cannot set `scope_headers` (remove it: every guarded request is \
                 scoped by its client certificate)",
                show_scope(&o.scope),
                self.scope_from
            ));
        }
        let show = |d: Duration| humantime::format_duration(d).to_string();
        if o.lease < MIN_LEASE {
            return Err(format!(
                "lease ({}) must be at least {} (idem_core::MIN_LEASE)",
                show(o.lease),
                show(MIN_LEASE)
            ));
        }
        if o.lease <= self.store_options.timeout {
            return Err(format!(
                "lease ({}) must be longer than --store-timeout ({})",
                show(o.lease),
                show(self.store_options.timeout)
            ));
        }
        if o.share_failure > idem_core::MAX_SHARE_FAILURE {
            return Err(format!(
                "share_failure ({}) is above {}: later retries would be answered the shared \
                 failure instead of running",
                show(o.share_failure),
                show(idem_core::MAX_SHARE_FAILURE)
            ));
        }
        if o.ttl < o.lease {
            return Err(format!(
                "ttl ({}) is shorter than the lease ({})",
                show(o.ttl),
                show(o.lease)
            ));
        }
        if o.max_body == 0 {
            return Err("max_body must be above 0".into());
        }
        if o.max_body > self.layer.max_buffered {
            return Err(format!(
                "max_body ({} bytes) is above --max-buffered ({} bytes)",
                o.max_body, self.layer.max_buffered
            ));
        }
        if route.require_token && o.ttl < self.layer.token_ttl {
            return Err(format!(
                "ttl ({}) is shorter than --token-ttl ({}); a result must outlive its submit token",
                show(o.ttl),
                show(self.layer.token_ttl)
            ));
        }
        if o.methods.is_empty() {
            return Err("methods names no method".into());
        }
        for m in &o.methods {
            check_method(m).map_err(|e| format!("methods: {e}"))?;
        }
        Ok(())
    }
}

/// A duration as `--help` shows it: the largest whole unit (`24h`, `30s`,
/// `1m`, `250ms`), `0` for none; [`parse_duration`] reads it back.
///
/// ```
/// use std::time::Duration;
/// assert_eq!(idem_gateway::show_duration(Duration::from_secs(86_400)), "24h");
/// assert_eq!(idem_gateway::show_duration(Duration::from_millis(1500)), "1500ms");
/// assert_eq!(idem_gateway::show_duration(Duration::ZERO), "0");
/// ```
pub fn show_duration(d: Duration) -> String {
    let ms = d.as_millis();
    if ms == 0 {
        return "0".into();
    }
    for (unit, per) in [("h", 3_600_000), ("m", 60_000), ("s", 1000)] {
        if ms % per == 0 {
            return format!("{}{unit}", ms / per);
        }
    }
    format!("{ms}ms")
}

/// A byte size as `--help` shows it: the largest whole binary unit
/// (`10MiB`, `64KiB`), else bytes; [`parse_size`] reads it back.
///
/// ```
/// assert_eq!(idem_gateway::show_size(10 * 1024 * 1024), "10MiB");
/// assert_eq!(idem_gateway::show_size(1000), "1000");
/// ```
pub fn show_size(bytes: usize) -> String {
    for (unit, per) in [("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)] {
        if bytes != 0 && bytes % per == 0 {
            return format!("{}{unit}", bytes / per);
        }
    }
    bytes.to_string()
}

/// The header names of a scope, comma-separated as `--scope-header` takes
/// them (`headers:`-less; `fixed` for a fixed scope).
pub(crate) fn show_scope(scope: &ScopeBy) -> String {
    match scope {
        ScopeBy::Headers(names) => names
            .iter()
            .map(HeaderName::as_str)
            .collect::<Vec<_>>()
            .join(","),
        ScopeBy::Fixed(_) => "fixed".to_owned(),
        ScopeBy::ClientCert => "client-cert".to_owned(),
    }
}

/// A configuration that cannot work.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A `[[routes]]` entry is refused ([`idem_http::RouteError`]).
    #[error("{0}")]
    Route(#[from] idem_http::RouteError),
    /// `--lease` below [`idem_core::MIN_LEASE`] (1 s): a claim could end
    /// before the upstream is even called, and duplicates would run again.
    #[error(
        "--lease ({}) must be at least {} (idem_core::MIN_LEASE): a shorter claim can end \
         before the upstream call starts, and duplicates of the request would run again",
        humantime::format_duration(*lease),
        humantime::format_duration(MIN_LEASE)
    )]
    LeaseTooShort {
        /// The lease given.
        lease: Duration,
    },
    /// `--lease` not longer than `--store-timeout`: one slow store call
    /// (the claim or a renewal) could outlast the whole lease.
    #[error(
        "--lease ({}) must be longer than --store-timeout ({}): one slow store call could \
         outlast the claim, and a duplicate would run again; raise --lease or lower \
         --store-timeout",
        humantime::format_duration(*lease),
        humantime::format_duration(*store_timeout)
    )]
    LeaseNotAboveStoreTimeout {
        /// The lease given.
        lease: Duration,
        /// The store timeout given.
        store_timeout: Duration,
    },
    /// `--share-failure` above [`idem_core::MAX_SHARE_FAILURE`] (1 min).
    #[error(
        "--share-failure ({}) must be at most {}: a shared failure is for the duplicates \
         that waited for it; a longer window would answer later retries the failure instead \
         of running them",
        humantime::format_duration(*share_failure),
        humantime::format_duration(idem_core::MAX_SHARE_FAILURE)
    )]
    ShareFailureTooLong {
        /// The window given.
        share_failure: Duration,
    },
    /// `--max-live-tokens` above half the memory store's record cap: a
    /// flood of submit tokens could fill the store, and every guarded
    /// request would get 503 `store-full`.
    #[error(
        "--max-live-tokens ({max_live_tokens}) must be at most half of the memory store's \
         idem_max_records ({max_records}), so that submit tokens cannot fill the store \
         that holds the results"
    )]
    TokensCrowdOutResults {
        /// The token cap given.
        max_live_tokens: usize,
        /// The memory store's record cap.
        max_records: usize,
    },
    /// The TTL ends before the lease: a result would be forgotten while its
    /// key could still be in flight.
    #[error(
        "--ttl ({}) is shorter than --lease ({}); the ttl must be at least the lease",
        humantime::format_duration(*ttl),
        humantime::format_duration(*lease)
    )]
    TtlShorterThanLease {
        /// The TTL given.
        ttl: Duration,
        /// The lease given.
        lease: Duration,
    },
    /// No `--upstream`, IDEM_UPSTREAM or `upstream` in the configuration file.
    #[error("--upstream or `upstream` in the config file is required")]
    NoUpstream,
    /// A setting that must be above zero is zero.
    #[error("{0} must be above 0")]
    Zero(&'static str),
    /// No guarded method.
    #[error("--methods names no method")]
    NoMethods,
    /// A method that cannot be guarded.
    #[error("--methods: {0}")]
    Method(String),
    /// The upstream URL is not usable.
    #[error("--upstream: {0}")]
    Upstream(String),
    /// A file of `--upstream-ca` or `--upstream-client-cert/-key` cannot be
    /// read or used, or no system root certificate loads for an `https://`
    /// upstream without `--upstream-ca`. The message names the flag and
    /// the file.
    #[error(transparent)]
    UpstreamTls(crate::tls::TlsError),
    /// The upstream TLS settings do not fit together (a client certificate
    /// without its key, or TLS settings for an `http://` upstream).
    #[error("{0}")]
    UpstreamTlsSettings(String),
    /// The store URL is not usable.
    #[error("--store: {0}")]
    Store(#[source] idem_core::StoreError),
    /// A `--scope-header` name is not a valid header name or cannot identify
    /// a caller, or no scope header is given.
    #[error("--scope-header: {0}")]
    ScopeHeader(String),
    /// `--scope-from client-cert` cannot work as set: without
    /// `--tls-client-ca` (no request would carry a verified certificate),
    /// with an explicit `--scope-header`, a route with `scope_headers`, or a
    /// [`GatewayConfig`] whose `layer.scope` and `scope_from` disagree.
    #[error("--scope-from: {0}")]
    ScopeFrom(String),
    /// A TLS certificate, key or CA file cannot be used (it names the flag
    /// and the file).
    #[error(transparent)]
    Tls(#[from] crate::tls::TlsError),
    /// A `--require-token` prefix is not a path prefix.
    #[error("--require-token: {0}")]
    RequireToken(String),
    /// `--max-buffered` is below `--max-body`: bodies between the two
    /// could never be read.
    #[error("--max-buffered ({max_buffered} bytes) is below --max-body ({max_body} bytes); a body of up to --max-body must fit in the budget")]
    BufferedBelowMaxBody {
        /// The budget given.
        max_buffered: usize,
        /// The body limit given.
        max_body: usize,
    },
    /// The file-descriptor limit leaves no room for a client connection
    /// once the store and the upstream have their share.
    #[error("--max-connections: the file-descriptor limit (RLIMIT_NOFILE, `ulimit -n`) is {nofile}, and {reserve} are kept for the store pool and the gateway itself, leaving room for no client connection with its upstream connection; raise the limit (e.g. `ulimit -n 4096`, systemd LimitNOFILE=) or lower --store-pool-size")]
    NoRoomForConnections {
        /// The soft limit read at start.
        nofile: u64,
        /// The descriptors kept back.
        reserve: u64,
    },
    /// `--admin-token-file` cannot be read or holds no usable token.
    #[error("{0}")]
    AdminToken(String),
}

/// The longest duration [`parse_duration`] accepts: 100 years (of 365.25
/// days, humantime's `y`). No lease, TTL or timeout needs more, and every
/// duration up to it prints ([`show_duration`], humantime) in a form that
/// parses back to the same value.
pub const MAX_DURATION: Duration = Duration::from_secs(100 * 31_557_600);

/// Parses a duration such as `500ms`, `30s`, `24h` or `0`, at most
/// [`MAX_DURATION`] (100 years).
///
/// # Errors
/// A message naming the accepted forms, or saying the duration is longer
/// than 100 years.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(s.trim())
        .map_err(|e| format!("{e}; use a number with a unit, like 500ms, 30s, 5m or 24h"))?;
    if d > MAX_DURATION {
        return Err(format!(
            "{:?} is longer than the most accepted, 100 years (100y)",
            s.trim()
        ));
    }
    Ok(d)
}

/// Parses a byte size: `1048576`, `512KiB`, `10MiB`, `1MB` (= 1,000,000), `2GiB`.
///
/// # Errors
/// A message when the number or the suffix is not understood, or the size
/// overflows `usize`.
pub fn parse_size(s: &str) -> Result<usize, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    if num.is_empty() {
        return Err(format!(
            "{s:?} is not a size; use bytes (1048576) or a suffix (KB, KiB, MB, MiB, GB, GiB)"
        ));
    }
    let n: u64 = num
        .parse()
        .map_err(|_| format!("{s:?}: the number is too large"))?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" => 1000,
        "ki" | "kib" => 1024,
        "m" | "mb" => 1000 * 1000,
        "mi" | "mib" => 1024 * 1024,
        "g" | "gb" => 1000 * 1000 * 1000,
        "gi" | "gib" => 1024 * 1024 * 1024,
        other => {
            return Err(format!(
                "{s:?}: unknown size suffix {other:?}; use KB, KiB, MB, MiB, GB or GiB"
            ))
        }
    };
    n.checked_mul(mult)
        .and_then(|b| usize::try_from(b).ok())
        .ok_or_else(|| format!("{s:?} is too large"))
}

/// Parses one method name, case-insensitive, and refuses those that cannot
/// be guarded.
///
/// # Errors
/// A message for an empty or malformed name, a safe method (RFC 9110 §9.2.1)
/// or CONNECT.
pub fn parse_method(s: &str) -> Result<Method, String> {
    let t = s.trim();
    if t.is_empty() {
        return Err("empty method name (use a comma-separated list such as POST,PATCH)".into());
    }
    let m = Method::from_bytes(t.to_ascii_uppercase().as_bytes())
        .map_err(|_| format!("{t:?} is not a valid method name"))?;
    check_method(&m)?;
    Ok(m)
}

/// Parses one `--scope-header` name, case-insensitive (`X-Api-Key` →
/// `x-api-key`), and refuses those that cannot identify a caller.
///
/// ```
/// assert_eq!(idem_gateway::parse_scope_header(" X-Api-Key ").unwrap(), "x-api-key");
/// assert!(idem_gateway::parse_scope_header("x api key").is_err());
/// assert!(idem_gateway::parse_scope_header("Idempotency-Key").is_err());
/// ```
///
/// # Errors
/// A message for an empty name, one that is not an RFC 9110 field name
/// (a token: letters, digits and ``!#$%&'*+-.^_`|~``), `Idempotency-Key`
/// itself, or a hop-by-hop field ([`crate::HOP_BY_HOP`]), which describes
/// the connection rather than the caller.
pub fn parse_scope_header(s: &str) -> Result<HeaderName, String> {
    let t = s.trim();
    if t.is_empty() {
        return Err(
            "empty header name (use a comma-separated list such as authorization,x-api-key)".into(),
        );
    }
    let name = HeaderName::from_bytes(t.as_bytes())
        .map_err(|_| format!("{t:?} is not a valid header name"))?;
    check_scope_header(&name)?;
    Ok(name)
}

fn check_scope_header(name: &HeaderName) -> Result<(), String> {
    if name.as_str() == "idempotency-key" {
        return Err(
            "Idempotency-Key cannot scope itself; name a header that identifies the caller, \
             such as authorization or x-api-key"
                .into(),
        );
    }
    if crate::proxy::HOP_BY_HOP.contains(&name.as_str()) {
        return Err(format!(
            "{name} is a hop-by-hop field that describes the connection, not the caller; \
             name a header such as authorization or x-api-key"
        ));
    }
    Ok(())
}

pub(crate) fn check_method(m: &Method) -> Result<(), String> {
    if [
        Method::GET,
        Method::HEAD,
        Method::OPTIONS,
        Method::TRACE,
        Method::CONNECT,
    ]
    .contains(m)
    {
        return Err(format!(
            "{m} cannot be guarded (safe methods are idempotent already, CONNECT is not proxied); \
             use methods such as POST, PATCH, PUT, DELETE"
        ));
    }
    Ok(())
}

/// Checks one `--require-token` path prefix: trimmed, it must start with
/// `/` and hold no `?`, `#` or whitespace.
///
/// ```
/// assert_eq!(idem_gateway::parse_token_prefix(" /pay ").unwrap(), "/pay");
/// assert!(idem_gateway::parse_token_prefix("pay").is_err());
/// assert!(idem_gateway::parse_token_prefix("/pay?x=1").is_err());
/// ```
///
/// # Errors
/// A message for an empty prefix, one without a leading `/`, or one with a
/// query, a fragment or whitespace.
pub fn parse_token_prefix(s: &str) -> Result<String, String> {
    let t = s.trim();
    if t.is_empty() {
        return Err("empty path prefix (use a comma-separated list such as /pay,/checkout)".into());
    }
    if !t.starts_with('/') {
        return Err(format!("{t:?} must start with '/', e.g. /pay"));
    }
    if t.contains(['?', '#']) || t.contains(char::is_whitespace) {
        return Err(format!(
            "{t:?} must be a path prefix without query, fragment or spaces"
        ));
    }
    Ok(t.to_owned())
}

/// Parses one `--trusted-proxy` entry: a CIDR (`10.0.0.0/8`,
/// `2001:db8::/32`) or a single address (`192.0.2.7`, taken as `/32` or
/// `/128`). Host bits are cleared (`10.1.2.3/8` is `10.0.0.0/8`).
///
/// ```
/// assert_eq!(idem_gateway::parse_trusted_proxy(" 10.1.2.3/8 ").unwrap().to_string(), "10.0.0.0/8");
/// assert_eq!(idem_gateway::parse_trusted_proxy("::1").unwrap().to_string(), "::1/128");
/// assert!(idem_gateway::parse_trusted_proxy("10.0.0.0/33").is_err());
/// assert!(idem_gateway::parse_trusted_proxy("proxy.internal").is_err());
/// ```
///
/// # Errors
/// A message for anything that is not an IP address or a CIDR.
pub fn parse_trusted_proxy(s: &str) -> Result<IpNet, String> {
    let t = s.trim();
    if let Ok(net) = t.parse::<IpNet>() {
        return Ok(net.trunc());
    }
    if let Ok(ip) = t.parse::<std::net::IpAddr>() {
        return Ok(IpNet::from(ip.to_canonical()));
    }
    Err(format!(
        "{t:?} is not an IP address or a CIDR such as 10.0.0.0/8 or fd00::/8 (host names are not accepted)"
    ))
}

/// Parses and checks an upstream URL: `http://host[:port][/prefix]` or
/// `https://host[:port][/prefix]` (the port defaults to 80 and 443), without
/// user info, query or fragment. Surrounding ASCII whitespace is ignored;
/// the URL itself must be printable ASCII (percent-encode anything else),
/// so that its printed form parses back to the same URL.
///
/// # Errors
/// A message saying what is wrong with the URL.
pub fn parse_upstream(s: &str) -> Result<Uri, String> {
    let t = s.trim_matches(|c: char| c.is_ascii_whitespace());
    if let Some(c) = t.chars().find(|c| !c.is_ascii_graphic()) {
        return Err(format!(
            "{t:?} holds {c:?}; an upstream URL must be printable ASCII without spaces \
             (percent-encode other characters)"
        ));
    }
    if t.contains('#') {
        return Err(format!("{t:?}: the upstream URL cannot have a fragment"));
    }
    let uri: Uri = t
        .parse()
        .map_err(|e| format!("{t:?} is not a valid URL ({e}); expected http://host:port"))?;
    match uri.scheme_str() {
        Some("http" | "https") => {}
        Some(other) => {
            return Err(format!(
                "{t:?}: scheme {other:?} is not supported; use an http:// or https:// URL"
            ))
        }
        None => return Err(format!("{t:?} has no scheme; expected http://host:port")),
    }
    let Some(auth) = uri.authority() else {
        return Err(format!("{t:?} has no host; expected http://host:port"));
    };
    if auth.as_str().contains('@') {
        return Err(format!(
            "{t:?}: user info in the upstream URL is not supported"
        ));
    }
    if auth.host().is_empty() {
        return Err(format!("{t:?} has no host; expected http://host:port"));
    }
    if uri.query().is_some() {
        return Err(format!("{t:?}: the upstream URL cannot have a query"));
    }
    // The prefix is what no request may leave: it must be one plain path
    // (no `..`, `//`, `%2F`, …; idem_http::normalize_path).
    let prefix = uri.path().trim_end_matches('/');
    if !prefix.is_empty() {
        match idem_http::normalize_path(prefix) {
            Ok(std::borrow::Cow::Borrowed(_)) => {}
            Ok(std::borrow::Cow::Owned(n)) => {
                return Err(format!(
                    "{t:?}: the path prefix {prefix:?} is not in normal form; write it as {n:?}"
                ))
            }
            Err(e) => return Err(format!("{t:?}: the path prefix {prefix:?} is refused: {e}")),
        }
    }
    Ok(uri)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser, Debug)]
    struct Cli {
        #[command(flatten)]
        g: GatewayArgs,
    }

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        let mut v = vec!["idem"];
        v.extend_from_slice(args);
        Cli::try_parse_from(v)
    }

    #[test]
    fn defaults() {
        let c = parse(&["--upstream", "http://127.0.0.1:3000"])
            .unwrap()
            .g
            .into_config()
            .unwrap();
        assert_eq!(c.listen, "127.0.0.1:8000".parse().unwrap());
        assert_eq!(c.store.expose(), "sqlite://idem.db");
        assert_eq!(c.layer.ttl, Duration::from_secs(86400));
        assert_eq!(c.layer.lease, Duration::from_secs(30));
        assert_eq!(c.layer.methods, vec![Method::POST, Method::PATCH]);
        assert!(!c.layer.require_key);
        assert_eq!(c.layer.max_body, 10_485_760);
        assert_eq!(c.layer.retention_limit, 1_048_576);
        assert_eq!(c.upstream_timeout, Duration::from_secs(30));
        assert_eq!(c.upstream_idle_timeout, Duration::from_secs(1));
        assert_eq!(c.layer.wait, Duration::ZERO);
        assert_eq!(scope_names(&c), vec!["authorization"]);
        assert_eq!(c.store_options.pool_size, 16);
        assert_eq!(c.store_options.timeout, Duration::from_secs(5));
        assert!(!c.fail_open);
        assert_eq!(c.layer.token_ttl, Duration::from_secs(3600));
        assert!(c.layer.require_token.is_empty());
        assert_eq!(c.header_timeout, Duration::from_secs(10));
        assert_eq!(c.layer.body_timeout, Duration::from_secs(30));
        assert_eq!(c.max_connections, 10_000);
        assert_eq!(c.layer.max_buffered, 256 << 20);
    }

    #[test]
    fn connection_flags() {
        let g = |extra: &[&str]| {
            let mut a = vec!["--upstream", "http://x:1", "--store", "memory://"];
            a.extend_from_slice(extra);
            parse(&a).unwrap().g.into_config()
        };
        let c = g(&[
            "--header-timeout",
            "2s",
            "--body-timeout",
            "500ms",
            "--max-connections",
            "7",
            "--max-buffered",
            "20MiB",
        ])
        .unwrap();
        assert_eq!(c.header_timeout, Duration::from_secs(2));
        assert_eq!(c.layer.body_timeout, Duration::from_millis(500));
        assert_eq!(c.max_connections, 7);
        assert_eq!(c.layer.max_buffered, 20 << 20);
        assert_eq!(c.connection_cap().unwrap().connections, 7);
        for (flag, name) in [
            ("--header-timeout", "--header-timeout"),
            ("--body-timeout", "--body-timeout"),
            ("--max-connections", "--max-connections"),
        ] {
            assert!(
                matches!(g(&[flag, "0"]), Err(ConfigError::Zero(n)) if n == name),
                "{flag}"
            );
        }
        assert!(matches!(
            g(&["--max-buffered", "1MiB"]),
            Err(ConfigError::BufferedBelowMaxBody { .. })
        ));
        assert!(g(&["--max-buffered", "1MiB", "--max-body", "1MiB"]).is_ok());
    }

    #[test]
    fn trusted_proxy_flag() {
        let g = |extra: &[&str]| {
            let mut a = vec!["--upstream", "http://x:1", "--store", "memory://"];
            a.extend_from_slice(extra);
            parse(&a).map(|c| c.g.into_config().unwrap())
        };
        assert!(g(&[]).unwrap().trusted_proxies.is_empty());
        let c = g(&[
            "--trusted-proxy",
            "10.0.0.0/8, 192.0.2.7",
            "--trusted-proxy",
            "fd00::/8",
        ])
        .unwrap();
        let shown: Vec<String> = c.trusted_proxies.iter().map(ToString::to_string).collect();
        assert_eq!(shown, ["10.0.0.0/8", "192.0.2.7/32", "fd00::/8"]);
        for bad in ["", "10.0.0.0/40", "proxy", "10.0.0.1/x"] {
            assert!(g(&["--trusted-proxy", bad]).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn purge_interval_flag() {
        let g = |extra: &[&str]| {
            let mut a = vec!["--upstream", "http://x:1", "--store", "memory://"];
            a.extend_from_slice(extra);
            parse(&a).unwrap().g.into_config()
        };
        assert_eq!(g(&[]).unwrap().purge_interval, Duration::from_secs(60));
        assert_eq!(
            g(&["--purge-interval", "5m"]).unwrap().purge_interval,
            Duration::from_secs(300)
        );
        assert!(matches!(
            g(&["--purge-interval", "0"]),
            Err(ConfigError::Zero("--purge-interval"))
        ));
    }

    #[test]
    fn help_shows_the_defaults_it_parses_back() {
        let d = GatewayConfig::new("http://x:1".parse().unwrap());
        let c = parse(&["--upstream", "http://x:1"])
            .unwrap()
            .g
            .into_config()
            .unwrap();
        assert_eq!(format!("{:?}", c), format!("{:?}", d));
        assert_eq!(parse_duration(&show_duration(d.layer.ttl)), Ok(d.layer.ttl));
        assert_eq!(
            parse_size(&show_size(d.layer.max_body)),
            Ok(d.layer.max_body)
        );
    }

    #[test]
    fn token_flags() {
        let g = |extra: &[&str]| {
            let mut a = vec!["--upstream", "http://x:1", "--store", "memory://"];
            a.extend_from_slice(extra);
            parse(&a).unwrap().g.into_config()
        };
        let c = g(&[
            "--require-token",
            "/pay, /checkout/",
            "--require-token",
            "/pay",
            "--token-ttl",
            "15m",
        ])
        .unwrap();
        assert_eq!(c.layer.require_token, vec!["/pay", "/checkout/"]);
        assert_eq!(c.layer.token_ttl, Duration::from_secs(900));
        assert!(matches!(
            g(&["--token-ttl", "0"]),
            Err(ConfigError::Zero("--token-ttl"))
        ));
        let capped = g(&["--token-ttl", "2h", "--ttl", "30m"]).unwrap();
        assert_eq!(
            capped.layer.token_ttl,
            Duration::from_secs(1800),
            "capped at --ttl"
        );
        for bad in ["pay", "", "/pay?x", "/a b"] {
            assert!(
                matches!(
                    g(&["--require-token", bad]),
                    Err(ConfigError::RequireToken(_))
                ),
                "{bad:?}"
            );
        }
    }

    fn scope_names(c: &GatewayConfig) -> Vec<String> {
        match &c.layer.scope {
            ScopeBy::Headers(names) => names.iter().map(ToString::to_string).collect(),
            other => panic!("not a header scope: {other:?}"),
        }
    }

    #[test]
    fn a_share_failure_window_over_a_minute_is_refused() {
        let g = |extra: &[&str]| {
            let mut a = vec!["--upstream", "http://x:1", "--store", "memory://"];
            a.extend_from_slice(extra);
            parse(&a).unwrap().g.into_config()
        };
        for ok in ["0", "1ms", "1s", "1m"] {
            assert!(g(&["--share-failure", ok]).is_ok(), "{ok}");
        }
        for bad in ["61s", "1h", "100000h"] {
            let e = g(&["--share-failure", bad]).unwrap_err();
            assert!(
                matches!(e, ConfigError::ShareFailureTooLong { .. }),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn leases_that_void_the_guarantee_are_refused() {
        let g = |extra: &[&str]| {
            let mut a = vec!["--upstream", "http://x:1", "--store", "memory://"];
            a.extend_from_slice(extra);
            parse(&a).unwrap().g.into_config()
        };
        for lease in ["1ns", "999us", "1ms", "999ms"] {
            let e = g(&["--lease", lease]).unwrap_err();
            assert!(
                matches!(e, ConfigError::LeaseTooShort { .. }),
                "{lease}: {e}"
            );
            assert!(e.to_string().starts_with("--lease ("), "{e}");
        }
        let e = g(&["--lease", "1s", "--store-timeout", "1s"]).unwrap_err();
        assert!(
            matches!(e, ConfigError::LeaseNotAboveStoreTimeout { .. }),
            "{e}"
        );
        assert!(e.to_string().contains("--store-timeout (1s)"), "{e}");
        assert!(matches!(
            g(&["--lease", "5s"]),
            Err(ConfigError::LeaseNotAboveStoreTimeout { .. })
        ));
        let e = g(&["--ttl", "500ms", "--lease", "1s"]).unwrap_err();
        assert!(e.to_string().starts_with("--ttl (500ms)"), "{e}");
        let ok = g(&["--lease", "1s", "--store-timeout", "999ms"]).unwrap();
        assert_eq!(ok.layer.lease, MIN_LEASE);
        assert!(ok.layer.validate().is_ok());
    }

    #[test]
    fn token_budget_flags() {
        let g = |extra: &[&str]| {
            let mut a = vec!["--upstream", "http://x:1"];
            a.extend_from_slice(extra);
            parse(&a).unwrap().g.into_config()
        };
        let d = g(&["--store", "memory://"]).unwrap();
        assert!(!d.issue_tokens && !d.tokens_served());
        assert!(!d.layer.anonymous_tokens);
        assert_eq!(d.layer.tokens_per_scope, 100);
        assert_eq!(d.layer.max_live_tokens, 100_000);
        let c = g(&[
            "--store",
            "memory://",
            "--issue-tokens",
            "--anonymous-tokens",
            "--tokens-per-scope",
            "7",
            "--max-live-tokens",
            "70",
        ])
        .unwrap();
        assert!(c.issue_tokens && c.tokens_served() && c.layer.anonymous_tokens);
        assert_eq!((c.layer.tokens_per_scope, c.layer.max_live_tokens), (7, 70));
        assert!(g(&["--store", "memory://", "--require-token", "/pay"])
            .unwrap()
            .tokens_served());
        for (flag, name) in [
            ("--tokens-per-scope", "--tokens-per-scope"),
            ("--max-live-tokens", "--max-live-tokens"),
        ] {
            assert!(matches!(
                g(&["--store", "memory://", flag, "0"]),
                Err(ConfigError::Zero(n)) if n == name
            ));
        }
        // Tokens may take at most half of a memory store's records.
        let small = "memory://?idem_max_records=100";
        let e = g(&["--store", small, "--issue-tokens"]).unwrap_err();
        assert!(
            matches!(e, ConfigError::TokensCrowdOutResults { .. }),
            "{e}"
        );
        assert!(e.to_string().starts_with("--max-live-tokens"), "{e}");
        assert!(g(&[
            "--store",
            small,
            "--issue-tokens",
            "--max-live-tokens",
            "50"
        ])
        .is_ok());
        assert!(g(&[
            "--store",
            small,
            "--max-live-tokens",
            "51",
            "--issue-tokens"
        ])
        .is_err());
        assert!(g(&["--store", small]).is_ok(), "no tokens served, no check");
    }

    #[test]
    fn scope_headers_are_repeatable_and_comma_separated() {
        let g = |extra: &[&str]| {
            let mut a = vec!["--upstream", "http://x:1", "--store", "memory://"];
            a.extend_from_slice(extra);
            parse(&a).unwrap().g.into_config()
        };
        let c = g(&["--scope-header", "X-Api-Key"]).unwrap();
        assert_eq!(scope_names(&c), vec!["x-api-key"]);
        let c = g(&[
            "--scope-header",
            "authorization, x-api-key",
            "--scope-header",
            "X-Tenant",
            "--scope-header",
            "x-api-key",
        ])
        .unwrap();
        assert_eq!(
            scope_names(&c),
            vec!["authorization", "x-api-key", "x-tenant"],
            "in order, duplicates dropped"
        );
        let c = g(&["--scope-header=cookie"]).unwrap();
        assert_eq!(scope_names(&c), vec!["cookie"]);
    }

    #[test]
    fn scope_from_client_cert_needs_a_client_ca_and_no_scope_header() {
        let g = |extra: &[&str]| {
            let mut a = vec!["--upstream", "http://x:1", "--store", "memory://"];
            a.extend_from_slice(extra);
            parse(&a).unwrap().g.into_config()
        };
        let tls = ["--tls-cert", "c.pem", "--tls-key", "k.pem"];
        let with = |more: &[&'static str]| {
            let mut v: Vec<&str> = tls.to_vec();
            v.extend_from_slice(more);
            g(&v)
        };
        let e = with(&["--scope-from", "client-cert"]).unwrap_err();
        assert!(
            matches!(&e, ConfigError::ScopeFrom(m) if m.contains("--tls-client-ca")),
            "{e}"
        );
        let c = with(&["--tls-client-ca", "ca.pem", "--scope-from", "client-cert"]).unwrap();
        assert_eq!(c.layer.scope, ScopeBy::ClientCert);
        assert_eq!(c.scope_from, ScopeFrom::ClientCert);
        assert_eq!(show_scope(&c.layer.scope), "client-cert");
        let e = with(&[
            "--tls-client-ca",
            "ca.pem",
            "--scope-from",
            "client-cert",
            "--scope-header",
            "x-api-key",
        ])
        .unwrap_err();
        assert!(matches!(e, ConfigError::ScopeFrom(_)), "{e}");
        // A route that would scope by headers under client-cert.
        let mut c = c;
        let mut o = c.layer.clone();
        o.scope = ScopeBy::Headers(vec![HeaderName::from_static("x-api-key")]);
        c.routes
            .push(idem_http::Route::new("by-header", "/h", o).unwrap());
        let e = c.validate().unwrap_err().to_string();
        assert!(
            e.contains("by-header") && e.contains("scope_headers"),
            "{e}"
        );
        // Headers (the default) need no TLS.
        assert!(matches!(g(&[]).unwrap().layer.scope, ScopeBy::Headers(_)));
    }

    #[test]
    fn bad_scope_headers_are_config_errors() {
        for bad in [
            "x api key",
            "x-api-key:",
            "caf\u{e9}",
            "",
            "a,,b",
            "idempotency-key",
            "Connection",
            "transfer-encoding",
        ] {
            let r = parse(&[
                "--upstream",
                "http://x:1",
                "--store",
                "memory://",
                "--scope-header",
                bad,
            ])
            .unwrap()
            .g
            .into_config();
            match r {
                Err(e @ ConfigError::ScopeHeader(_)) => {
                    assert!(e.to_string().starts_with("--scope-header: "), "{e}")
                }
                other => panic!("{bad:?}: {other:?}"),
            }
        }
        let mut c = GatewayConfig::new("http://x:1".parse().unwrap());
        c.store = "memory://".into();
        c.layer.scope = ScopeBy::Headers(Vec::new());
        assert!(matches!(c.validate(), Err(ConfigError::ScopeHeader(_))));
        c.layer.scope = ScopeBy::Headers(vec![HeaderName::from_static("upgrade")]);
        assert!(matches!(c.validate(), Err(ConfigError::ScopeHeader(_))));
        c.layer.scope = ScopeBy::Fixed(idem_core::Scope::new("tenant").unwrap());
        assert!(c.validate().is_ok());
    }

    #[test]
    fn flags_are_parsed() {
        let c = parse(&[
            "--upstream",
            "http://localhost:3000/api",
            "--listen",
            "0.0.0.0:9000",
            "--store",
            "memory://",
            "--ttl",
            "1h",
            "--lease",
            "1500ms",
            "--methods",
            "post,Put,DELETE",
            "--require-key",
            "--max-body",
            "1MB",
            "--retention-limit",
            "64KiB",
            "--upstream-timeout",
            "5s",
            "--upstream-idle-timeout",
            "250ms",
            "--wait",
            "2s",
            "--store-pool-size",
            "4",
            "--store-timeout",
            "750ms",
            "--fail-open",
        ])
        .unwrap()
        .g
        .into_config()
        .unwrap();
        assert_eq!(c.layer.lease, Duration::from_millis(1500));
        assert_eq!(
            c.layer.methods,
            vec![Method::POST, Method::PUT, Method::DELETE]
        );
        assert!(c.layer.require_key);
        assert_eq!(c.layer.max_body, 1_000_000);
        assert_eq!(c.layer.retention_limit, 65_536);
        assert_eq!(c.layer.wait, Duration::from_secs(2));
        assert_eq!(c.upstream_timeout, Duration::from_secs(5));
        assert_eq!(c.upstream_idle_timeout, Duration::from_millis(250));
        assert_eq!(c.upstream.path(), "/api");
        assert_eq!(c.store_options.pool_size, 4);
        assert_eq!(c.store_options.timeout, Duration::from_millis(750));
        assert!(c.fail_open);
    }

    #[test]
    fn bad_values_are_refused() {
        for args in [
            vec!["--upstream", "https://u:p@x:1"],
            vec!["--upstream", "https://x:1?q=1"],
            vec!["--upstream", "ftp://x:1"],
            vec!["--upstream", "not a url"],
            vec!["--upstream", "localhost:3000"],
            vec!["--upstream", "http://u:p@x:1"],
            vec!["--upstream", "http://x:1/api/../admin"],
            vec!["--upstream", "http://x:1//api"],
            vec!["--upstream", "http://x:1/a%2Fb"],
            vec!["--upstream", "http://x:1", "--methods", "GET"],
            vec!["--upstream", "http://x:1", "--methods", "POST,,PATCH"],
            vec!["--upstream", "http://x:1", "--methods", "PO ST"],
            vec!["--upstream", "http://x:1", "--ttl", "soon"],
            vec!["--upstream", "http://x:1", "--max-body", "10XB"],
            vec!["--upstream", "http://x:1", "--max-body", "-1"],
            vec!["--upstream", "http://x:1", "--listen", "localhost"],
        ] {
            assert!(parse(&args).is_err(), "{args:?} parsed");
        }
        assert!(matches!(
            parse(&[]).unwrap().g.into_config(),
            Err(ConfigError::NoUpstream)
        ));
    }

    #[cfg(all(feature = "postgres", feature = "mysql", feature = "redis"))]
    #[test]
    fn cross_checks() {
        let g = |extra: &[&str]| {
            let mut a = vec!["--upstream", "http://x:1", "--store", "memory://"];
            a.extend_from_slice(extra);
            parse(&a).unwrap().g.into_config()
        };
        assert!(matches!(
            g(&["--lease", "0"]),
            Err(ConfigError::LeaseTooShort { .. })
        ));
        assert!(matches!(
            g(&["--lease", "10s", "--ttl", "5s"]),
            Err(ConfigError::TtlShorterThanLease { .. })
        ));
        assert!(g(&["--lease", "1s", "--ttl", "1s", "--store-timeout", "500ms"]).is_ok());
        assert!(matches!(
            g(&["--upstream-timeout", "0"]),
            Err(ConfigError::Zero(_))
        ));
        assert!(matches!(
            g(&["--upstream-idle-timeout", "0"]),
            Err(ConfigError::Zero("--upstream-idle-timeout"))
        ));
        let mut c = GatewayConfig::new("http://x:1".parse().unwrap());
        c.store = "memory://".into();
        c.upstream_idle_timeout = Duration::ZERO;
        assert!(matches!(
            c.validate(),
            Err(ConfigError::Zero("--upstream-idle-timeout"))
        ));
        assert!(matches!(g(&["--max-body", "0"]), Err(ConfigError::Zero(_))));
        assert!(matches!(
            g(&["--store-pool-size", "0"]),
            Err(ConfigError::Zero("--store-pool-size"))
        ));
        assert!(matches!(
            g(&["--store-timeout", "0"]),
            Err(ConfigError::Zero("--store-timeout"))
        ));
        let store = |url: &str| {
            parse(&["--upstream", "http://x:1", "--store", url])
                .unwrap()
                .g
                .into_config()
        };
        let e = store("mongodb://db/x").unwrap_err();
        assert!(matches!(e, ConfigError::Store(_)), "{e}");
        let msg = format!("{e}: {}", std::error::Error::source(&e).unwrap());
        assert!(
            msg.contains("--store") && msg.contains("sqlite://"),
            "{msg}"
        );
        assert!(matches!(
            store("postgres://db/x?idem_table=no-dashes"),
            Err(ConfigError::Store(_))
        ));
        for ok in [
            "postgres://u@db:5432/x?idem_table=t&idem_schema=s",
            "mariadb://root@db/test",
            "redis://127.0.0.1:6379/?idem_prefix=app",
            "redis+cluster://a:1,b:2",
        ] {
            assert_eq!(store(ok).unwrap().store.expose(), ok);
        }
    }

    #[cfg(feature = "postgres")]
    #[test]
    fn debug_hides_the_store_password() {
        let cli = parse(&[
            "--upstream",
            "http://x:1",
            "--store",
            "postgres://idem:s3cret@db/app",
        ])
        .unwrap();
        assert!(!format!("{:?}", cli.g).contains("s3cret"));
        let c = cli.g.into_config().unwrap();
        let shown = format!("{c:?}");
        assert!(
            !shown.contains("s3cret") && shown.contains("idem:***@db"),
            "{shown}"
        );
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("0"), Ok(0));
        assert_eq!(parse_size("10485760"), Ok(10_485_760));
        assert_eq!(parse_size("10MiB"), Ok(10_485_760));
        assert_eq!(parse_size("10 mib"), Ok(10_485_760));
        assert_eq!(parse_size("1MB"), Ok(1_000_000));
        assert_eq!(parse_size("2k"), Ok(2000));
        assert_eq!(parse_size("1GiB"), Ok(1 << 30));
        assert!(parse_size("").is_err());
        assert!(parse_size("MB").is_err());
        assert!(parse_size("1.5MB").is_err());
        assert!(parse_size("99999999999999999999999").is_err());
        assert!(parse_size("99999999999999GiB").is_err());
    }

    #[test]
    fn durations_beyond_100_years_are_refused() {
        // fuzz/crashes/duration: ~677 years, whose milliseconds humantime
        // could not read back.
        let e = parse_duration(" 500ms   3  5 3  55wks").unwrap_err();
        assert!(e.contains("100 years"), "{e}");
        assert_eq!(parse_duration("100y"), Ok(MAX_DURATION));
        assert!(parse_duration("101y").is_err());
        let shown = show_duration(MAX_DURATION - Duration::from_millis(1));
        assert_eq!(
            parse_duration(&shown),
            Ok(MAX_DURATION - Duration::from_millis(1))
        );
    }

    #[test]
    fn upstreams_outside_printable_ascii_are_refused() {
        // fuzz/crashes/upstream: U+2000 around the URL and inside its path.
        let crash = String::from_utf8_lossy(&[
            0xe2, 0x80, 0x80, 0x68, 0x74, 0x74, 0x70, 0x3a, 0x2f, 0x2f, 0x32, 0x38, 0x6c, 0x2f,
            0xe2, 0x80, 0xe2, 0x80, 0xe2, 0x80, 0x80, 0x23, 0x80, 0x6a, 0x80,
        ])
        .into_owned();
        assert!(parse_upstream(&crash).is_err());
        assert!(parse_upstream("\u{2000}http://h:1").is_err());
        assert!(parse_upstream("http://h:1/a\u{e9}").is_err());
        assert!(parse_upstream("http://h:1/a b").is_err());
        assert!(parse_upstream("http://h:1/a#x").is_err());
        let u = parse_upstream(" \thttp://h:1/api\n").unwrap();
        assert_eq!(parse_upstream(&u.to_string()), Ok(u));
    }
}
