//! # idem-gateway
//!
//! A reverse proxy that gives any HTTP service the guarantees of the
//! `Idempotency-Key` header (IETF httpapi draft "The Idempotency-Key HTTP
//! Header Field") without a line of its code changing: a guarded request
//! (POST and PATCH by default) carrying a key runs upstream at most once per
//! key and caller; duplicates get the stored response back byte for byte,
//! marked `Idempotent-Replayed: true`, or `409` while the first copy runs.
//! The `idem gateway` command is a thin wrapper around this crate.
//!
//! ```text
//! client ──► [ /_idem/* endpoints | idem_http::IdempotencyLayer ──► proxy ] ──► upstream
//!                                        │
//!                                      store (memory:// | sqlite://)
//! ```
//!
//! ## Use
//!
//! ```no_run
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! use clap::Parser;
//! #[derive(Parser)]
//! struct Cli {
//!     #[command(flatten)]
//!     gateway: idem_gateway::GatewayArgs,
//! }
//! let config = Cli::parse().gateway.into_config()?;
//! let gateway = idem_gateway::Gateway::bind(config).await?;
//! gateway.serve(idem_gateway::shutdown_signal()).await?;
//! # Ok(()) }
//! ```
//!
//! ## Flags ([`GatewayArgs`])
//!
//! | flag | variable | default | meaning |
//! |---|---|---|---|
//! | `--listen ADDR` | `IDEM_LISTEN` | `127.0.0.1:8000` | `IP:PORT` to listen on |
//! | `--upstream URL` | `IDEM_UPSTREAM` | required | `http://host:port[/prefix]` |
//! | `--store URL` | `IDEM_STORE` | `sqlite://idem.db` | `memory://`, `sqlite://rel.db`, `sqlite:///abs.db` |
//! | `--ttl` | `IDEM_TTL` | `24h` | replay window |
//! | `--lease` | `IDEM_LEASE` | `30s` | claim lease, renewed while the call runs; > 0 and ≤ ttl |
//! | `--methods` | `IDEM_METHODS` | `POST,PATCH` | guarded methods |
//! | `--require-key` | `IDEM_REQUIRE_KEY` | off | 400 for a guarded request without key |
//! | `--max-body` | `IDEM_MAX_BODY` | `10485760` | largest guarded request body (bytes; `10MiB`, `1MB` accepted) |
//! | `--retention-limit` | `IDEM_RETENTION_LIMIT` | `1MiB` | largest response body kept for replay |
//! | `--upstream-timeout` | `IDEM_UPSTREAM_TIMEOUT` | `30s` | time allowed for the upstream's response headers |
//! | `--wait` | `IDEM_WAIT` | `0` | how long a duplicate waits for the original (0: 409 at once) |
//! | `--scope-header NAME` | `IDEM_SCOPE_HEADER` | `authorization` | headers whose values scope a key (SHA-256 over them); repeatable, comma-separated |
//!
//! ## Whose key it is
//!
//! A key belongs to the caller that sent it: the record is addressed by the
//! key *and* a scope, the SHA-256 over the names and values of the
//! `--scope-header` fields (by default every `Authorization` field, in
//! order). Two callers with different credentials that pick the same key
//! each run once and each get their own response. A request carrying none
//! of the headers falls into one shared anonymous scope, so put the gateway
//! behind whatever authenticates callers, or require the header upstream.
//! Name the header your callers authenticate with, e.g.
//! `--scope-header x-api-key`.
//!
//! ## What the proxy does to a request
//!
//! - Method, path, query, headers and body are forwarded; the upstream URL's
//!   path prefix, if any, is put in front of the path.
//! - Hop-by-hop fields (RFC 9110 §7.6.1) are removed in both directions:
//!   `Connection` and the fields it names, `Keep-Alive`, `Proxy-Connection`,
//!   `TE`, `Trailer`, `Transfer-Encoding`, `Upgrade` (so protocol upgrades
//!   such as WebSocket are not proxied). `Expect` is removed too: this hop
//!   already answered `100-continue`. See [`strip_hop_by_hop`].
//! - `X-Forwarded-For` gets the client's IP appended ([`append_forwarded_for`]);
//!   `X-Forwarded-Proto: http` is added when absent.
//! - **`Host` is rewritten to the upstream's authority** (as nginx's
//!   `proxy_pass` does by default) and the client's original `Host` is
//!   passed as `X-Forwarded-Host` (unless an earlier proxy set one). The
//!   upstream is addressed by its own name, so a virtual-hosted upstream or
//!   one behind a name-based router answers as it would to a direct call;
//!   services that build absolute URLs can read `X-Forwarded-Host`.
//! - `Idempotency-Key` is forwarded unchanged (even if `Connection` names it),
//!   so the service behind can use it as its own last line of defence.
//! - Requests that are not guarded (other methods, no key) stream through
//!   without buffering; guarded ones are buffered (up to `--max-body`) so
//!   they can be fingerprinted.
//!
//! ## Upstream failures and the key
//!
//! Errors are `application/problem+json` (RFC 9457) with
//! `type = "urn:idem:problem:<kind>"`:
//!
//! | what happened | answer | the key |
//! |---|---|---|
//! | connection refused / connect timeout (nothing sent) | 502 `upstream-unreachable` | released: a retry runs |
//! | no response headers within `--upstream-timeout` | 504 `upstream-timeout` | held until its lease ends (the call may still land) |
//! | connection broke after the request was sent | 502 `upstream-failed` | held until its lease ends |
//! | body broke before `--retention-limit` bytes (buffered, nothing sent yet) | 502 `upstream-failed` | held until its lease ends |
//! | body broke past `--retention-limit` (already streaming) | the upstream's status, body cut short | completed without its body: duplicates get 410 |
//! | upstream answered 5xx, 408, 409, 425, 429 | as answered | released |
//! | upstream answered anything else | as answered | stored and replayed |
//! | store unreachable when the request arrives | 503 (from the layer) | upstream not called |
//!
//! The connect timeout is half the upstream timeout, at most 5 s, so an
//! unreachable host is reported as such rather than as a timeout.
//!
//! ## Reserved paths
//!
//! Paths under `/_idem/` are answered by the gateway and never proxied:
//! `GET /_idem/health` → `200 {"status":"ok","store":"sqlite"}` after a
//! read from the store (a `503` problem when the store fails); any other
//! `/_idem/*` path → `404` problem.
//!
//! ## Shutdown and housekeeping
//!
//! On SIGINT or SIGTERM ([`shutdown_signal`]) the gateway stops accepting,
//! closes idle keep-alive connections, and lets in-flight requests finish:
//! their results are stored before their responses leave. It then waits for
//! guarded requests whose clients already disconnected (they run on in the
//! layer's tracked tasks) to store their results too. The whole wait is
//! bounded by [`GatewayConfig::shutdown_grace`] (30 s); keys of runs still
//! going then stay in flight until their leases end. Expired records are
//! purged every [`GatewayConfig::purge_interval`] (60 s).

mod config;
mod proxy;
mod server;
mod store;

pub use config::{
    parse_duration, parse_method, parse_scope_header, parse_size, parse_upstream, ConfigError,
    GatewayArgs, GatewayConfig,
};
pub use proxy::{append_forwarded_for, strip_hop_by_hop, HOP_BY_HOP};
pub use server::{shutdown_signal, Gateway, GatewayError, RESERVED_PREFIX};
pub use store::open_store;
