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
//!                                      store (memory:// | sqlite:// | postgres:// | mysql:// | redis://)
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
//! | `--store URL` | `IDEM_STORE` | `sqlite://idem.db` | see [Stores](#stores) |
//! | `--store-pool-size N` | `IDEM_STORE_POOL_SIZE` | `16` | pooled connections to PostgreSQL / MySQL, per instance; > 0 |
//! | `--store-timeout DURATION` | `IDEM_STORE_TIMEOUT` | `5s` | longest store call (pool wait included), and the connect timeout at startup; > 0 |
//! | `--fail-open` | `IDEM_FAIL_OPEN` | off | **dangerous**: forward unprotected when the store is down at `begin` (see [Store outages](#store-outages)) |
//! | `--ttl` | `IDEM_TTL` | `24h` | replay window |
//! | `--lease` | `IDEM_LEASE` | `30s` | claim lease, renewed while the call runs; at least 1 s ([`idem_core::MIN_LEASE`]), longer than `--store-timeout`, ≤ ttl |
//! | `--methods` | `IDEM_METHODS` | `POST,PATCH` | guarded methods |
//! | `--require-key` | `IDEM_REQUIRE_KEY` | off | 400 for a guarded request without key |
//! | `--max-body` | `IDEM_MAX_BODY` | `10MiB` | largest guarded request body (bytes; `10MiB`, `1MB` accepted) |
//! | `--retention-limit` | `IDEM_RETENTION_LIMIT` | `1MiB` | largest response body kept for replay |
//! | `--upstream-timeout` | `IDEM_UPSTREAM_TIMEOUT` | `30s` | time allowed for the upstream's response headers, and for each gap between two chunks of its response body (idle timeout, not a bound on the whole body); > 0 |
//! | `--upstream-idle-timeout` | `IDEM_UPSTREAM_IDLE_TIMEOUT` | `1s` | how long a pooled keep-alive connection to the upstream may sit unused before it is closed instead of reused; keep it below the upstream's keep-alive timeout (Node.js 5 s, gunicorn 2 s); > 0 |
//! | `--wait` | `IDEM_WAIT` | `0` | how long a duplicate waits for the original (0: 409 at once) |
//! | `--scope-header NAME` | `IDEM_SCOPE_HEADER` | `authorization` | headers whose values scope a key (SHA-256 over them); repeatable, comma-separated |
//! | `--token-ttl DURATION` | `IDEM_TOKEN_TTL` | `1h` | how long a submit token from `POST /_idem/tokens` may be used for a first submit; > 0, capped at `--ttl` |
//! | `--require-token PATH_PREFIX` | `IDEM_REQUIRE_TOKEN` | none | guarded requests under this path prefix need a live submit token as their key (428 without one, 403 `token-unknown` for an unknown or expired one); repeatable, comma-separated; turns `POST /_idem/tokens` on |
//! | `--issue-tokens` | `IDEM_ISSUE_TOKENS` | off | serve `POST /_idem/tokens` without a `--require-token` route (otherwise 404) |
//! | `--anonymous-tokens` | `IDEM_ANONYMOUS_TOKENS` | off | issue tokens to callers without any `--scope-header` (otherwise 400 `scope-required`); they share one scope |
//! | `--tokens-per-scope N` | `IDEM_TOKENS_PER_SCOPE` | `100` | most live (unused, unexpired) tokens per caller scope, per instance; 429 `too-many-tokens` + `Retry-After` beyond; > 0 |
//! | `--max-live-tokens N` | `IDEM_MAX_LIVE_TOKENS` | `100000` | most live tokens in all, per instance (each is a store record); 429 beyond; > 0, with `memory://` at most half its `idem_max_records` |
//! | `--otlp-endpoint URL` | `IDEM_OTLP_ENDPOINT` | none (no export) | export traces over OTLP/HTTP (protobuf) to this collector base URL (`/v1/traces` is appended); needs the feature `otel` (on in the `idem` binary); see [`otel`] |
//! | `--purge-interval DURATION` | `IDEM_PURGE_INTERVAL` | `1m` | how often expired records are deleted from the store (the first purge one interval after start); an expired record is never replayed, purged or not; > 0 |
//!
//! ## Stores
//!
//! | URL | store | share between |
//! |---|---|---|
//! | `memory://` | in-process map | one process |
//! | `sqlite://rel.db`, `sqlite:///abs.db` | SQLite file (WAL, `synchronous=FULL`) | processes on one machine |
//! | `postgres://user:pw@host:5432/db` (`postgresql://`) | PostgreSQL 10+ | any number of instances |
//! | `mysql://user:pw@host:3306/db` (`mariadb://`) | MySQL 8.0+ / MariaDB 10.5+ (InnoDB) | any number of instances |
//! | `redis://host:6379/[db]`, `rediss://…` (TLS), `redis+unix:///path.sock` | Redis 7+ | any number of instances |
//! | `redis+cluster://host:port,host:port` (`rediss+cluster://`) | Redis Cluster | any number of instances |
//!
//! Gateway options ride in the URL's query and are removed before it
//! reaches the driver: `idem_table`, `idem_schema`, `idem_migrate`
//! (PostgreSQL, MySQL), `idem_prefix` (Redis), e.g.
//! `postgres://idem@db/app?idem_schema=idem&sslmode=require`. See
//! [`open_store_with`] and `docs/STORES.md` (which store to choose, what it
//! guarantees, round trips, how wait mode works across instances). Redis
//! replicates asynchronously: a failover or a restart without persistence
//! can lose acknowledged records, and a key can then run twice (at start
//! the gateway reads the server's `appendonly`/`save` settings and logs a
//! WARN when a restart would forget completed keys). Where a
//! second execution costs money, use PostgreSQL. Passwords in store URLs
//! are printed as `***`. `GET /_idem/ready` reports the kind
//! (`memory`, `sqlite`, `postgres`, `mysql`, `redis`, `redis-cluster`).
//!
//! ## Store outages
//!
//! - **At startup** the store must answer within `--store-timeout`, or the
//!   gateway exits (status 1, message naming the store): fail fast, and
//!   let a supervisor restart it. A malformed URL is a configuration error
//!   (status 2).
//! - **Later**, every store call is bounded by `--store-timeout`. A guarded
//!   request whose `begin` fails or times out gets `503`
//!   `store-unavailable` and the upstream is not called (fail closed);
//!   service resumes by itself when the store is back.
//! - A failure or timeout while **saving** a result never frees the key:
//!   the first caller still gets the upstream's answer, duplicates get 409
//!   until the lease ends (CASES A1).
//! - **`--fail-open`** (off by default) — **can double-charge**: a guarded
//!   request whose `begin` failed is forwarded to the upstream without
//!   protection, answered with `Idempotency-Status: unprotected`
//!   ([`IDEMPOTENCY_STATUS`]) and logged at WARN. Nothing is recorded in
//!   the store; this instance remembers the key in memory, so a retry of
//!   it to the same instance during the outage gets 503 instead of running
//!   again (a retry to another instance, or after a restart, runs again).
//!   Never applied when the upstream was already called (a failed save,
//!   an upstream's own 503), nor to a key this instance saw claimed, in
//!   flight, completed or forwarded within the last `--lease` + `--wait`.
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
//!   `TE`, `Trailer`, `Transfer-Encoding`, `Upgrade`. `Expect` is removed
//!   too: this hop already answered `100-continue`. See [`strip_hop_by_hop`].
//! - **Upgrades** (WebSocket): an HTTP/1.1 `GET` (or `HEAD`, `OPTIONS`,
//!   `TRACE`: the methods idem never guards) with `Connection: upgrade` and
//!   `Upgrade` keeps both fields for the upstream; its `101 Switching
//!   Protocols` goes back to the client and the two connections are joined
//!   until either side closes. A guarded request is never upgraded (its
//!   `Upgrade` is stripped; an upstream 101 to it is a 502
//!   `upstream-protocol`, the key released), nor is HTTP/2 extended
//!   CONNECT (RFC 8441). An upgraded connection counts against
//!   `--max-connections` until it closes, has no idle timeout, and is closed
//!   at the shutdown deadline.
//! - `X-Forwarded-For` gets the client's IP appended ([`append_forwarded_for`]);
//!   `X-Forwarded-Proto: http` (`https` on the TLS listener) is added when absent.
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
//! | no body chunk for `--upstream-timeout` before `--retention-limit` bytes | 502 `upstream-failed` | held until its lease ends |
//! | connection broke after the request was sent | 502 `upstream-failed` | held until its lease ends |
//! | body broke before `--retention-limit` bytes (buffered, nothing sent yet) | 502 `upstream-failed` | held until its lease ends |
//! | body broke past `--retention-limit` (already streaming) | the upstream's status, body cut short | completed without its body: duplicates get 410 |
//! | upstream answered 5xx, 408, 409, 425, 429 | as answered | released |
//! | upstream answered anything else | as answered | stored and replayed |
//! | store unreachable when the request arrives | 503 `store-unavailable` (from the layer) | upstream not called (with `--fail-open`: forwarded unprotected) |
//! | store fails or times out while saving the result | the upstream's answer | held until its lease ends |
//!
//! The connect timeout is half the upstream timeout, at most 5 s, so an
//! unreachable host is reported as such rather than as a timeout. A body
//! that stalls past `--retention-limit` (already streaming) is cut short
//! after `--upstream-timeout` without a chunk, like a broken one.
//!
//! Pooled connections to the upstream are dropped after
//! `--upstream-idle-timeout` (1 s) unused. An upstream that closes idle
//! keep-alive connections sooner than that races the gateway: a request
//! sent as the connection closes fails with an unknown outcome (502
//! `upstream-failed`, key held), so set the flag below the upstream's
//! keep-alive timeout.
//!
//! ## Reserved paths
//!
//! Paths under `/_idem/` are answered by the gateway and never proxied
//! (the probes also on the admin listener; see `docs/HEALTH.md`):
//! `GET /_idem/live` → `200 {"status":"ok"}` while the process serves (no
//! store call); `GET /_idem/ready` → `200 {"status":"ok","store":"sqlite"}`
//! when the store accepts a write — a canary `begin` + `release` on the
//! reserved scope `_idem` and the key `_idem-ready-<instance id>`, which
//! leaves no record, bounded by 2 s, its result cached for at most 1 s and
//! shared by concurrent probes — else `503` `application/problem+json`
//! (`store-unavailable`, or `store-full` for a full disk or store) with
//! members `store` and `reason` (`unavailable`, `timeout`, `read-only`,
//! `disk-full`, `full`, `corrupt`, `file-deleted`: a SQLite file deleted
//! or replaced under the running gateway, which stays unready until it is
//! restarted); `GET /_idem/health` is the same as ready. All three answer
//! `GET` and `HEAD` (`405` otherwise);
//! `POST /_idem/tokens` (only with a `--require-token` route or
//! `--issue-tokens`; otherwise `404`) → `201`
//! `{"token":"tok_…","expires_in":3600}` (`application/json`;
//! `expires_in` in whole seconds): a submit token for the caller's scope
//! (the scope the layer derives from the `--scope-header` fields); `400`
//! `scope-required` without any of those fields (unless
//! `--anonymous-tokens`), `429` `too-many-tokens` with `Retry-After` past
//! `--tokens-per-scope` or `--max-live-tokens`, a `503` problem when the
//! store fails; any other `/_idem/*` path → `404` problem.
//!
//! ## Submit tokens
//!
//! `POST /_idem/tokens` issues a one-time token (see
//! [`idem_core::token`]); with `--require-token /pay`, a guarded request
//! under `/pay` must carry a live token of its caller as its
//! `Idempotency-Key`. Its first use runs upstream once; a concurrent
//! second use gets 409, a later one the stored response (even after the
//! token's TTL, while the result is retained). A request without a key gets
//! 428 `token-required`; a token never issued to this caller, or one whose
//! `--token-ttl` passed before its first use, gets 403 `token-unknown`. The
//! upstream is not called in either case. `--fail-open` never applies to
//! these routes: a token cannot be checked without the store.
//!
//! Every token is a store record until it is used or expires, so issuing
//! is budgeted: per caller scope (`--tokens-per-scope`, 100) and in all
//! (`--max-live-tokens`, 100,000), counted by each gateway instance for the
//! tokens it issued (N instances: up to N × the cap in the store). A token
//! stops counting when a submit stores its result (or finds it used) or
//! when its `--token-ttl` ends.
//!
//! ## Shutdown and housekeeping
//!
//! On SIGINT or SIGTERM ([`shutdown_signal`]) the gateway stops accepting,
//! closes idle keep-alive connections, and lets in-flight requests finish:
//! their results are stored before their responses leave. It then waits for
//! guarded requests whose clients already disconnected (they run on in the
//! layer's tracked tasks) to store their results too. The whole wait is
//! bounded by [`GatewayConfig::shutdown_grace`] (30 s); keys of runs still
//! going then stay in flight until their leases end. Upgraded connections
//! (WebSocket) are waited for within the same bound and closed at its end.
//! Expired records are
//! purged every [`GatewayConfig::purge_interval`] (`--purge-interval`,
//! 60 s), the first time one interval after start.
//!
//! # Configuration file
//! [`config_file::load`] layers a TOML file (`idem gateway --config FILE`,
//! docs/CONFIG.md) under the flags and the IDEM_* variables: its top-level
//! keys are the flags' long names with `-` written `_`, and its
//! `[[routes]]` become [`GatewayConfig::routes`]. [`config_file::schema`]
//! is its JSON Schema. The gateway reloads the routes and the per-request
//! settings from the file on SIGHUP and when it changes ([`reload`]).

mod admin;
mod config;
mod guard;
mod health;
pub mod keys;
mod limits;
pub mod otel;
mod proxy;
mod server;
mod store;
pub mod tls;
mod upgrade;

pub use config::file as config_file;
pub use config::reload;
pub use config::{parse_admin_listen, AdminListen, DEFAULT_ADMIN_LISTEN};
pub use config::{
    parse_duration, parse_method, parse_scope_header, parse_size, parse_token_prefix,
    parse_trusted_proxy, parse_upstream, show_duration, show_size, ConfigError, GatewayArgs,
    GatewayConfig, IpNet, DEFAULT_LISTEN, DEFAULT_PURGE_INTERVAL, DEFAULT_SHUTDOWN_GRACE,
    DEFAULT_STORE, DEFAULT_UPSTREAM_IDLE_TIMEOUT, DEFAULT_UPSTREAM_TIMEOUT,
};
pub use config::{parse_scope_from, ScopeFrom};
pub use config::{DEFAULT_HEADER_TIMEOUT, DEFAULT_MAX_CONNECTIONS, MAX_DURATION};
/// The response field that marks an answer given without protection
/// (`Idempotency-Status: unprotected`, see [Store outages](#store-outages)).
pub use idem_http::IDEMPOTENCY_STATUS;
pub use otel::{parse_otlp_endpoint, OtlpEndpoint};
pub use proxy::{append_forwarded_for, strip_hop_by_hop, HOP_BY_HOP};
pub use server::{shutdown_signal, Gateway, GatewayError, RESERVED_PREFIX};
pub use store::{open_store, open_store_with, StoreOptions};
