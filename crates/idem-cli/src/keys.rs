//! `idem keys`: find and free keys, talking to the store directly.
//!
//! ```text
//! idem keys list   --store URL [--scope-header NAME:VALUE … | --scope-hash HEX] [--state S] [--limit N] [--cursor C | --all] [--json]
//! idem keys get    --store URL [--scope-header NAME:VALUE … | --scope-hash HEX] KEY [--json]
//! idem keys delete --store URL [--scope-header NAME:VALUE … | --scope-hash HEX] KEY [--json]
//! idem keys complete --store URL [scope] KEY --status N [--header NAME:VALUE …] [--body TEXT | --body-file F] [--ttl D] [--force] [--json]
//! idem keys purge  --store URL [--json]
//! ```
//!
//! The store is opened as the gateway opens it (`idem_gateway::open_store_with`,
//! the same URLs and `idem_*` options; `IDEM_STORE` when `--store` is not
//! given). The operations and the `--json` shapes are
//! `idem_gateway::keys`'s, the same as the admin API's.
//!
//! Exit status: 0 done; 1 the key is absent (`get`, `delete`, `complete`),
//! not held or completed already (`complete`), or the store failed; 2 a
//! malformed flag or store URL.

use std::fmt::Write as _;
use std::process::ExitCode;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use clap::{Args, Subcommand};
use idem_core::admin::{ListQuery, StateFilter, MAX_LIST_LIMIT};
use idem_core::{DynStore, IdempotencyKey, Scope, StoreError};
use idem_gateway::keys::{self as ops, Deleted, KeyPage, KeyRecord, KeysError, ShortScope};
use idem_gateway::StoreOptions;

/// The long help of `idem keys`.
pub(crate) const LONG_ABOUT: &str = "Find and free idempotency keys: list the records of a \
     store, show one, delete one (a key stuck in flight after a crash, so that a retry runs now \
     instead of after its lease), purge expired records. Talks to the store directly, with the \
     same --store URL as the gateway (IDEM_STORE).\n\n\
     A key belongs to a scope: the hash the gateway derives from the caller's --scope-header \
     fields. Name it by the header values the client sent (--scope-header \
     'authorization:Bearer abc', repeated for several fields, in the gateway's --scope-header \
     order) or by its hash (--scope-hash, 64 hex digits as `idem keys list --json` shows it, or \
     `anonymous`). Without either, get and delete use the anonymous scope (requests that \
     carried none of the scope headers) and list shows every scope.\n\n\
     Exit status: 0 done, 1 key absent or store failure, 2 malformed flags.";

/// `idem keys …`.
#[derive(Debug, Args)]
pub(crate) struct KeysArgs {
    #[command(subcommand)]
    command: KeysCommand,
}

#[derive(Debug, Subcommand)]
enum KeysCommand {
    /// List records, in flight and completed, newest first where the store
    /// can order them.
    List(ListArgs),
    /// Show the record of one key.
    Get(KeyArgs),
    /// Delete the record of one key, whatever its state (a retry then runs
    /// again). Releases a held key. Logged at WARN with who, what and when.
    Delete(KeyArgs),
    /// Settle a held key (its outcome was unknown: 504, broken body, result
    /// not saved) with the answer its duplicates get from now on, e.g.
    /// after checking the upstream's own records. Only a held key unless
    /// --force. Logged at WARN with who, what and when.
    Complete(CompleteArgs),
    /// Delete expired records (results past their TTL, claims past their
    /// lease) and print how many.
    Purge(PurgeArgs),
}

/// The store and the output format.
#[derive(Debug, Args)]
struct StoreArgs {
    /// The store, as the gateway's --store: memory://, sqlite://idem.db,
    /// postgres://…, mysql://…, redis://… (with the same idem_* options).
    #[arg(long, env = "IDEM_STORE", value_name = "URL")]
    store: String,

    /// The longest one store call may take (and the connect timeout).
    #[arg(
        long,
        env = "IDEM_STORE_TIMEOUT",
        value_name = "DURATION",
        default_value = "5s",
        value_parser = positive_duration
    )]
    store_timeout: Duration,

    /// Print JSON (the shapes of the admin API) instead of a table.
    #[arg(long)]
    json: bool,
}

/// Which scope.
#[derive(Debug, Args)]
struct ScopeArgs {
    /// A header field the client sent, as NAME:VALUE (e.g.
    /// 'authorization:Bearer abc'); the scope is the hash the gateway derives
    /// from them. Repeat for several fields, in the gateway's --scope-header
    /// order.
    #[arg(long = "scope-header", value_name = "NAME:VALUE", value_parser = scope_pair, conflicts_with = "scope_hash")]
    scope_header: Vec<String>,

    /// The scope by its hash: 64 hex digits (see `list --json`), or
    /// `anonymous`.
    #[arg(long, value_name = "HEX", value_parser = ops::parse_scope_hash)]
    scope_hash: Option<Scope>,
}

impl ScopeArgs {
    /// The named scope; `None` when neither flag is given.
    fn scope(&self) -> Result<Option<Scope>, String> {
        if let Some(s) = &self.scope_hash {
            return Ok(Some(s.clone()));
        }
        if self.scope_header.is_empty() {
            return Ok(None);
        }
        ops::scope_of_headers(&self.scope_header)
            .map(Some)
            .map_err(|e| format!("--scope-header {e}"))
    }
}

#[derive(Debug, Args)]
struct ListArgs {
    #[command(flatten)]
    store: StoreArgs,
    #[command(flatten)]
    scope: ScopeArgs,
    /// Only records in this state: in-flight, completed or any.
    #[arg(long, value_name = "STATE", default_value = "any", value_parser = ops::parse_state)]
    state: StateFilter,
    /// Most records to show, 1..=1000.
    #[arg(long, value_name = "N", default_value_t = 100, value_parser = list_limit)]
    limit: usize,
    /// Go on after the previous page (the cursor it printed).
    #[arg(long, value_name = "CURSOR")]
    cursor: Option<String>,
    /// Follow the cursor to the end and print every record at once (a
    /// Redis page may hold fewer than --limit records, even none, and still
    /// have a next one). Reads the whole store: mind its size.
    #[arg(long)]
    all: bool,
}

#[derive(Debug, Args)]
struct KeyArgs {
    #[command(flatten)]
    store: StoreArgs,
    #[command(flatten)]
    scope: ScopeArgs,
    /// The Idempotency-Key value.
    #[arg(value_name = "KEY", value_parser = idempotency_key)]
    key: IdempotencyKey,
}

#[derive(Debug, Args)]
struct CompleteArgs {
    #[command(flatten)]
    key: KeyArgs,
    /// The HTTP status duplicates get (100..=599).
    #[arg(long, value_name = "N")]
    status: u16,
    /// A header field duplicates get, NAME:VALUE (repeatable).
    #[arg(long = "header", short = 'H', value_name = "NAME:VALUE")]
    header: Vec<String>,
    /// The body duplicates get.
    #[arg(long, value_name = "TEXT", conflicts_with = "body_file")]
    body: Option<String>,
    /// The body duplicates get, read from a file (UTF-8).
    #[arg(long, value_name = "FILE")]
    body_file: Option<std::path::PathBuf>,
    /// How long the answer is replayed.
    #[arg(long, value_name = "DURATION", default_value = "24h", value_parser = positive_duration)]
    ttl: Duration,
    /// Complete a key that is in flight and not held (its request may still
    /// be running; its own result then loses).
    #[arg(long)]
    force: bool,
}

#[derive(Debug, Args)]
struct PurgeArgs {
    #[command(flatten)]
    store: StoreArgs,
}

fn positive_duration(s: &str) -> Result<Duration, String> {
    match idem_gateway::parse_duration(s)? {
        Duration::ZERO => Err("must be more than 0".into()),
        d => Ok(d),
    }
}

fn list_limit(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(n) if (1..=MAX_LIST_LIMIT).contains(&n) => Ok(n),
        _ => Err(format!(
            "{s:?} is not a number of records in 1..={MAX_LIST_LIMIT}"
        )),
    }
}

fn idempotency_key(s: &str) -> Result<IdempotencyKey, String> {
    IdempotencyKey::new(s).map_err(|e| e.to_string())
}

/// Checks one `NAME:VALUE` on its own (clap reports it with exit status 2).
fn scope_pair(s: &str) -> Result<String, String> {
    ops::scope_of_headers(&[s])?;
    Ok(s.to_owned())
}

/// Runs `idem keys …`.
pub(crate) async fn run(args: KeysArgs) -> ExitCode {
    match args.command {
        KeysCommand::List(a) => list(a).await,
        KeysCommand::Get(a) => get(a).await,
        KeysCommand::Delete(a) => delete(a).await,
        KeysCommand::Complete(a) => complete(a).await,
        KeysCommand::Purge(a) => purge(a).await,
    }
}

/// A failure: the message is printed, the status returned.
struct Failed(ExitCode);

fn usage(msg: impl std::fmt::Display) -> Failed {
    eprintln!("idem keys: {msg}");
    Failed(ExitCode::from(2))
}

fn store_failed(store: &StoreArgs, e: &KeysError) -> Failed {
    let url = idem_core::url::redact(store.store.trim());
    let hint = match e {
        KeysError::Store(StoreError::Invalid(_)) => return usage(e.chain()),
        KeysError::Store(StoreError::Timeout { .. }) => format!(
            " (no answer within --store-timeout {})",
            idem_gateway::show_duration(store.store_timeout)
        ),
        _ => String::new(),
    };
    eprintln!("idem keys: the store {url} failed: {}{hint}", e.chain());
    Failed(ExitCode::FAILURE)
}

/// `url` with `idem_migrate=false` added for PostgreSQL and MySQL unless
/// it names `idem_migrate`: an operator's command never creates a table (a
/// mistyped `idem_table` is an error, not an empty listing).
fn never_migrate(url: &str) -> String {
    let lower = url.to_ascii_lowercase();
    let sql = ["postgres:", "postgresql:", "mysql:", "mariadb:"]
        .iter()
        .any(|s| lower.starts_with(s));
    if !sql || lower.contains("idem_migrate=") {
        return url.to_owned();
    }
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}idem_migrate=false")
}

/// Opens the store as the gateway does.
async fn open(store: &StoreArgs) -> Result<DynStore, Failed> {
    let url = store.store.trim();
    let shown = idem_core::url::redact(url);
    if let Some(path) = sqlite_path(url) {
        if !std::path::Path::new(&path).exists() {
            return Err(usage(format!(
                "the SQLite store {shown} does not exist ({path}: no such file); the gateway \
                 creates it at its first start; a relative path is taken from the current \
                 directory"
            )));
        }
    }
    if url.to_ascii_lowercase().starts_with("memory:") {
        return Err(usage(
            "a memory:// store lives inside the gateway process that uses it; this command \
             would open a new, empty one. Use the gateway's admin API instead: GET /keys on \
             its --admin-listen address (see docs/KEYS.md)",
        ));
    }
    let url = &never_migrate(url);
    let options = StoreOptions::default()
        .with_timeout(store.store_timeout)
        .with_pool_size(2);
    match idem_gateway::open_store_with(url, &options).await {
        Ok(s) => Ok(s),
        Err(e @ StoreError::Config(_)) => Err(usage(format!("--store {shown}: {e}"))),
        Err(e) => {
            eprintln!(
                "idem keys: cannot open the store {shown}: {}",
                crate::chain(&e)
            );
            Err(Failed(ExitCode::FAILURE))
        }
    }
}

/// The file of a plain `sqlite://` URL, so that `idem keys` never creates
/// an empty database where the operator mistyped a path (`None` for other
/// URLs, and for paths with escapes, left to the store to read).
fn sqlite_path(url: &str) -> Option<String> {
    let (scheme, rest) = url.split_once("://")?;
    if !scheme.eq_ignore_ascii_case("sqlite") {
        return None;
    }
    let path = rest.split(['?', '#']).next().unwrap_or_default();
    if path.is_empty() || path.contains('%') || path == ":memory:" {
        return None;
    }
    Some(path.to_owned())
}

fn print_json<T: serde::Serialize>(v: &T) {
    // Serialising these plain structures cannot fail.
    println!("{}", serde_json::to_string(v).unwrap_or_default());
}

async fn list(a: ListArgs) -> ExitCode {
    let inner = async {
        let scope = a.scope.scope().map_err(usage)?;
        let store = open(&a.store).await?;
        let query = ListQuery {
            state: a.state,
            scope,
            limit: a.limit,
            cursor: a.cursor.clone(),
        };
        let mut query = query;
        let mut page = KeyPage::default();
        loop {
            let more = ops::list(&*store, &query, a.store.store_timeout)
                .await
                .map_err(|e| match e {
                    KeysError::NoListing => {
                        eprintln!(
                            "idem keys: the store {} cannot list its records; `idem keys get` \
                             and `delete` still work when you know the key",
                            idem_core::url::redact(a.store.store.trim())
                        );
                        Failed(ExitCode::FAILURE)
                    }
                    e => store_failed(&a.store, &e),
                })?;
            page.records.extend(more.records);
            page.next = more.next;
            page.newest_first = more.newest_first;
            match &page.next {
                Some(next) if a.all => query.cursor = Some(next.clone()),
                _ => break,
            }
        }
        if a.store.json {
            print_json(&page);
        } else {
            print!("{}", table(&page, now_ms()));
        }
        Ok::<_, Failed>(())
    };
    match inner.await {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failed(code)) => code,
    }
}

async fn get(a: KeyArgs) -> ExitCode {
    let inner = async {
        let scope = a
            .scope
            .scope()
            .map_err(usage)?
            .unwrap_or_else(Scope::anonymous);
        let store = open(&a.store).await?;
        match ops::get(&*store, &scope, &a.key, a.store.store_timeout).await {
            Ok(Some(rec)) => {
                if a.store.json {
                    print_json(&rec);
                } else {
                    print!("{}", details(&rec, now_ms()));
                }
                Ok(())
            }
            Ok(None) => Err(absent(&scope, &a.key)),
            Err(e) => Err(store_failed(&a.store, &e)),
        }
    };
    match inner.await {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failed(code)) => code,
    }
}

async fn delete(a: KeyArgs) -> ExitCode {
    let inner = async {
        let scope = a
            .scope
            .scope()
            .map_err(usage)?
            .unwrap_or_else(Scope::anonymous);
        let store = open(&a.store).await?;
        match ops::delete(&*store, &scope, &a.key, a.store.store_timeout).await {
            Ok(Some(d)) => {
                ops::log_deleted(&d, &operator(), "idem keys");
                if a.store.json {
                    print_json(&d);
                } else {
                    print!("{}", deleted(&d, now_ms()));
                }
                Ok(())
            }
            Ok(None) => Err(absent(&scope, &a.key)),
            Err(e) => Err(store_failed(&a.store, &e)),
        }
    };
    match inner.await {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failed(code)) => code,
    }
}

/// The [`ops::CompleteRequest`] the flags of `idem keys complete` name.
fn completion(a: &CompleteArgs) -> Result<ops::CompleteRequest, Failed> {
    let mut headers = std::collections::BTreeMap::new();
    for h in &a.header {
        let Some((name, value)) = h.split_once(':') else {
            return Err(usage(format!("--header {h:?} is not NAME:VALUE")));
        };
        headers.insert(
            name.trim().to_ascii_lowercase(),
            value.trim_matches([' ', '\t']).to_owned(),
        );
    }
    let body = match (&a.body, &a.body_file) {
        (Some(b), _) => b.clone(),
        (None, Some(f)) => std::fs::read_to_string(f)
            .map_err(|e| usage(format!("--body-file {}: {e}", f.display())))?,
        (None, None) => String::new(),
    };
    Ok(ops::CompleteRequest {
        status: a.status,
        headers,
        body,
        ttl: Some(idem_gateway::show_duration(a.ttl)),
        force: a.force,
    })
}

async fn complete(a: CompleteArgs) -> ExitCode {
    let inner = async {
        let k = &a.key;
        let scope = k
            .scope
            .scope()
            .map_err(usage)?
            .unwrap_or_else(Scope::anonymous);
        let (response, ttl) = completion(&a)?
            .to_response()
            .map_err(|e| usage(e.chain()))?;
        let store = open(&k.store).await?;
        match ops::complete(
            &*store,
            &scope,
            &k.key,
            &response,
            ttl,
            a.force,
            k.store.store_timeout,
        )
        .await
        {
            Ok(Some(c)) => {
                ops::log_completed(&c, response.status, &operator(), "idem keys");
                if k.store.json {
                    print_json(&c);
                } else {
                    println!(
                        "completed key {:?} in scope {} (key hash {}, fence {}): duplicates now get status {}",
                        c.key, c.scope, c.key_hash, c.fence, response.status
                    );
                }
                Ok(())
            }
            Ok(None) => Err(absent(&scope, &k.key)),
            Err(e @ (KeysError::NotHeld | KeysError::AlreadyCompleted | KeysError::Changed)) => {
                eprintln!("idem keys: {e}");
                Err(Failed(ExitCode::FAILURE))
            }
            Err(e) => Err(store_failed(&k.store, &e)),
        }
    };
    match inner.await {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failed(code)) => code,
    }
}

async fn purge(a: PurgeArgs) -> ExitCode {
    let inner = async {
        let store = open(&a.store).await?;
        let p = ops::purge(&*store, a.store.store_timeout)
            .await
            .map_err(|e| store_failed(&a.store, &e))?;
        if a.store.json {
            print_json(&p);
        } else {
            println!(
                "purged {} expired record{}",
                p.purged,
                if p.purged == 1 { "" } else { "s" }
            );
        }
        Ok::<_, Failed>(())
    };
    match inner.await {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failed(code)) => code,
    }
}

fn absent(scope: &Scope, key: &IdempotencyKey) -> Failed {
    eprintln!(
        "idem keys: no record of key {:?} in scope {} (absent, or past its TTL or lease); \
         check the scope (--scope-header / --scope-hash) or list them with `idem keys list`",
        key.as_str(),
        scope.as_str()
    );
    Failed(ExitCode::FAILURE)
}

/// Who runs this command, for the deletion log line: `user@host (pid N)`.
fn operator() -> String {
    let user = std::env::var("USER")
        .or_else(|_| std::env::var("LOGNAME"))
        .ok()
        .filter(|u| !u.trim().is_empty())
        .or_else(|| {
            std::fs::read_to_string("/proc/self/status")
                .ok()
                .and_then(|s| {
                    s.lines()
                        .find_map(|l| l.strip_prefix("Uid:"))
                        .and_then(|l| l.split_whitespace().next().map(|u| format!("uid {u}")))
                })
        })
        .unwrap_or_else(|| "unknown user".into());
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "unknown host".into());
    format!("{user}@{host} (pid {})", std::process::id())
}

// ------------------------------------------------------------- formatting

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// `ms` (since the Unix epoch) in local time, `2026-12-02 02:00:30`.
fn local_time(ms: u64) -> String {
    let Ok(ms) = i64::try_from(ms) else {
        return "far future".into();
    };
    match chrono::DateTime::from_timestamp_millis(ms) {
        Some(t) => t
            .with_timezone(&chrono::Local)
            .format("%Y-%m-%d %H:%M:%S")
            .to_string(),
        None => "far future".into(),
    }
}

/// `in 12 s`, `3 s ago`, `in 23 h`, `now`.
fn relative(at_ms: u64, now_ms: u64) -> String {
    let (d, future) = if at_ms >= now_ms {
        (at_ms - now_ms, true)
    } else {
        (now_ms - at_ms, false)
    };
    let s = d / 1000;
    let text = match s {
        0 if d < 500 => return "now".into(),
        0..120 => format!("{} s", s.max(1)),
        120..7200 => format!("{} min", s / 60),
        7200..172_800 => format!("{} h", s / 3600),
        _ => format!("{} d", s / 86_400),
    };
    if future {
        format!("in {text}")
    } else {
        format!("{text} ago")
    }
}

/// "lease ends 2026-12-02 02:00:30 (in 12 s)" and the like.
fn until(rec: &KeyRecord, now: u64) -> String {
    match (rec.lease_until_ms, rec.expires_at_ms) {
        (Some(t), _) if t <= now => format!(
            "lease ended {} ({}; the next request takes it over)",
            local_time(t),
            relative(t, now)
        ),
        (Some(t), _) => format!("lease ends {} ({})", local_time(t), relative(t, now)),
        (None, Some(t)) => format!("expires {} ({})", local_time(t), relative(t, now)),
        (None, None) => "-".into(),
    }
}

/// `in-flight`, `completed`, or `held (timeout)` for a held key.
fn state(rec: &KeyRecord) -> String {
    match &rec.held {
        Some(reason) => format!("held ({reason})"),
        None => rec.state.clone(),
    }
}

/// "201, 57 B" (status and stored body size).
fn response(rec: &KeyRecord) -> String {
    match &rec.response {
        Some(r) if r.body_omitted => format!("{}, body not kept", r.status),
        Some(r) => format!("{}, {} B", r.status, r.body_bytes),
        None => "-".into(),
    }
}

/// Cuts `s` to `max` characters (all keys are ASCII), marking the cut.
fn cut(s: &str, max: usize) -> String {
    if s.len() <= max {
        s.to_owned()
    } else {
        format!("{}…", &s[..max.saturating_sub(1)])
    }
}

/// The table of `idem keys list`.
fn table(page: &KeyPage, now: u64) -> String {
    let mut out = String::new();
    if page.records.is_empty() {
        out.push_str("no records\n");
        if let Some(next) = &page.next {
            let _ = writeln!(out, "more may follow (this store's pages can be empty): add --cursor {next}, or use --all");
        }
        return out;
    }
    let head = [
        "KEY",
        "SCOPE",
        "STATE",
        "FENCE",
        "LEASE END / EXPIRY",
        "FINGERPRINT",
        "RESPONSE",
        "KEY HASH",
    ];
    let rows: Vec<[String; 8]> = page
        .records
        .iter()
        .map(|r| {
            [
                cut(&r.key, 48),
                ShortScope(&r.scope).to_string(),
                state(r),
                r.fence.map_or_else(|| "-".into(), |f| f.to_string()),
                until(r, now),
                r.fingerprint.chars().take(12).collect(),
                response(r),
                r.key_hash.clone(),
            ]
        })
        .collect();
    let mut width = head.map(|h| h.chars().count());
    for row in &rows {
        for (w, c) in width.iter_mut().zip(row) {
            *w = (*w).max(c.chars().count());
        }
    }
    let mut line = |cells: &[&str]| {
        let mut l = String::new();
        for (i, c) in cells.iter().enumerate() {
            if i + 1 == cells.len() {
                l.push_str(c);
            } else {
                let pad = width[i] - c.chars().count();
                let _ = write!(l, "{c}{}  ", " ".repeat(pad));
            }
        }
        out.push_str(l.trim_end());
        out.push('\n');
    };
    line(&head);
    for row in &rows {
        let cells: Vec<&str> = row.iter().map(String::as_str).collect();
        line(&cells);
    }
    let flights = page
        .records
        .iter()
        .filter(|r| r.state == ops::STATE_IN_FLIGHT)
        .count();
    let _ = writeln!(
        out,
        "{} record{} ({flights} in flight, {} completed; {})",
        page.records.len(),
        if page.records.len() == 1 { "" } else { "s" },
        page.records.len() - flights,
        if page.newest_first {
            "newest first"
        } else {
            "in no particular order"
        }
    );
    if let Some(next) = &page.next {
        let _ = writeln!(out, "more: add --cursor {next} (or use --all)");
    }
    out
}

/// `idem keys get`: one field a line.
fn details(rec: &KeyRecord, now: u64) -> String {
    let mut out = String::new();
    let mut field = |name: &str, value: &str| {
        let _ = writeln!(out, "{name:<12} {value}");
    };
    field("key", &rec.key);
    field("scope", &rec.scope);
    field("key hash", &rec.key_hash);
    field("state", &state(rec));
    if let Some(f) = rec.fence {
        field("fence", &f.to_string());
    }
    field("until", &until(rec, now));
    field("fingerprint", &rec.fingerprint);
    if let Some(r) = &rec.response {
        let body = if r.body_omitted {
            "body not kept (duplicates get 410)".to_owned()
        } else {
            format!("{} B body", r.body_bytes)
        };
        field(
            "response",
            &format!("status {}, {body}, {} header fields", r.status, r.headers),
        );
    }
    out
}

/// `idem keys delete`: what was deleted.
fn deleted(d: &Deleted, now: u64) -> String {
    let what = match &d.record {
        Some(r) if r.state == ops::STATE_IN_FLIGHT => format!(
            "it was {}, fence {}, {}; the next request with this key runs",
            match &r.held {
                Some(reason) => format!("held ({reason}): released"),
                None => "in flight".to_owned(),
            },
            r.fence.unwrap_or_default(),
            until(r, now)
        ),
        Some(r) => format!(
            "it was completed, response {}, {}; the next request with this key runs again",
            response(r),
            until(r, now)
        ),
        None => "it was already expired".into(),
    };
    format!(
        "deleted key {:?} in scope {} (key hash {}): {what}\n",
        d.key, d.scope, d.key_hash
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use idem_gateway::keys::ResponseSummary;

    fn rec(state: &str) -> KeyRecord {
        KeyRecord {
            key: "order-1".into(),
            scope: "a".repeat(64),
            key_hash: "0123456789abcdef".into(),
            state: state.into(),
            held: None,
            fingerprint: "f".repeat(64),
            fence: (state == "in-flight").then_some(42),
            lease_until: None,
            lease_until_ms: (state == "in-flight").then_some(1_000_000 + 12_000),
            expires_at: None,
            expires_at_ms: (state == "completed").then_some(1_000_000 + 3_600_000 * 5),
            response: (state == "completed").then_some(ResponseSummary {
                status: 201,
                body_bytes: 57,
                body_omitted: false,
                headers: 2,
            }),
        }
    }

    #[test]
    fn relative_times() {
        assert_eq!(relative(12_000, 0), "in 12 s");
        assert_eq!(relative(0, 3_000), "3 s ago");
        assert_eq!(relative(100, 0), "now");
        assert_eq!(relative(900, 0), "in 1 s");
        assert_eq!(relative(600_000, 0), "in 10 min");
        assert_eq!(relative(0, 5 * 3_600_000), "5 h ago");
        assert_eq!(relative(3 * 86_400_000, 0), "in 3 d");
    }

    #[test]
    fn tables_show_what_an_operator_needs() {
        let page = KeyPage {
            records: vec![rec("in-flight"), rec("completed")],
            next: Some("f41".into()),
            newest_first: true,
        };
        let t = table(&page, 1_000_000);
        let lines: Vec<&str> = t.lines().collect();
        assert!(lines[0].starts_with("KEY "), "{t}");
        assert!(
            lines[1].contains("in-flight") && lines[1].contains("(in 12 s)"),
            "{t}"
        );
        assert!(
            lines[1].contains(" 42 ") && lines[1].contains("ffffffffffff "),
            "{t}"
        );
        assert!(lines[1].contains(&format!("{}…", "a".repeat(12))), "{t}");
        assert!(
            lines[2].contains("201, 57 B") && lines[2].contains("(in 5 h)"),
            "{t}"
        );
        assert!(lines[2].ends_with("0123456789abcdef"), "{t}");
        assert_eq!(
            lines[3],
            "2 records (1 in flight, 1 completed; newest first)"
        );
        assert_eq!(lines[4], "more: add --cursor f41 (or use --all)");
        assert_eq!(table(&KeyPage::default(), 0), "no records\n");
        let stale = until(&rec("in-flight"), 1_020_000);
        assert!(
            stale.contains("8 s ago") && stale.contains("takes it over"),
            "{stale}"
        );
        let d = details(&rec("completed"), 1_000_000);
        assert!(d.contains("status 201, 57 B body, 2 header fields"), "{d}");
    }

    #[test]
    fn sqlite_paths() {
        assert_eq!(sqlite_path("sqlite://idem.db").as_deref(), Some("idem.db"));
        assert_eq!(
            sqlite_path("SQLITE:///var/x.db?mode=rwc").as_deref(),
            Some("/var/x.db")
        );
        assert_eq!(sqlite_path("sqlite://a%20b.db"), None);
        assert_eq!(sqlite_path("postgres://h/db"), None);
    }
}
