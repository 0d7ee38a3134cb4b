//! Hot reload of the configuration file: on SIGHUP, and when the file
//! changes.
//!
//! The poll ([`POLL_INTERVAL`], every second) opens the file and reads its
//! metadata (size, modification time; on Unix also the inode and the
//! change time, so an editor's or a Kubernetes ConfigMap's rename over the
//! old file is seen); only when one of these moved is the file read
//! (at most [`MAX_CONFIG_FILE`] bytes) and hashed (SHA-256), so an
//! unchanged file costs one `open` and one `fstat` a second. A rewrite of
//! the same content is no reload. A change is applied only once the file
//! has stopped changing: it is looked at again every [`SETTLE`] (250 ms)
//! until two looks agree, at most [`SETTLE_TRIES`] times; a file still
//! changing then is left for the next poll. A file that disappears or
//! cannot be read is reported once (ERROR, counted as a failed reload, the
//! gauge drops to 0) and reloaded when it is back. Only a regular file is
//! watched (not a pipe such as `--config <(…)`).
//!
//! A reload reads the file again and layers it under the same command line
//! and environment as at start ([`super::file::load_for_reload`],
//! on a blocking thread, off the async workers), then validates the whole
//! configuration. A file with no key (empty, or only whitespace and
//! comments: truncated, or caught half-written) is refused. A good one
//! replaces the routes and the per-request settings of the layer
//! ([`RELOADABLE`]; [`idem_http::IdempotencyLayer::reload`]): requests in
//! flight finish under the rules they started with, and no connection is
//! dropped; INFO `configuration reloaded` with `routes` (the `[[routes]]`
//! tables, without the implicit `default`). Routes whose scope or key
//! source changed are named in a WARN (retries of requests stored before
//! are not recognised). A bad one changes nothing: ERROR `configuration
//! reload failed` with the reason (and the line); `/_idem/ready` is not
//! affected. Settings that need a restart (the listener, the store, the
//! upstream, the admin listener, limits and timeouts of the gateway itself:
//! every top-level key not in [`RELOADABLE`]) that changed are named in a
//! WARN and not applied; the reload still counts as applied.
//!
//! `scope_from` and the `tls_*` keys are restart-only like the listener:
//! a change is named in that WARN, and the layer and the routes keep the
//! way of scoping the gateway started with (certificate or headers). The
//! TLS certificate's *content* is reloaded on its own (see the TLS
//! listener: on SIGHUP and when its files change).
//!
//! Metrics: [`RELOADS`] `idem_config_reloads_total{result="ok"|"error"}`
//! and [`LAST_RELOAD_SUCCESS`] `idem_config_last_reload_success` (1 or 0).

use std::path::Path;
use std::time::{Duration, SystemTime};

use idem_http::{IdempotencyLayer, ScopeBy};
use sha2::{Digest, Sha256};
use tokio_util::sync::CancellationToken;

use super::file::{load_for_reload, ConfigSource, Report, MAX_CONFIG_FILE};

/// Counter of reloads by result, label `result` = `ok` | `error`.
pub const RELOADS: &str = "idem_config_reloads_total";
/// Gauge: 1 when the last reload (or the start) applied the file, 0 when
/// the last reload was refused.
pub const LAST_RELOAD_SUCCESS: &str = "idem_config_last_reload_success";
/// How often the file is looked at: every 1 s.
pub const POLL_INTERVAL: Duration = Duration::from_secs(1);
/// How long a changed file must stay the same before the poll applies
/// it: 250 ms between two looks that must agree.
pub const SETTLE: Duration = Duration::from_millis(250);
/// How many times a changed file is looked at again, [`SETTLE`] apart,
/// before the poll gives up until its next round: 8 (2 s).
pub const SETTLE_TRIES: u32 = 8;

/// The top-level keys a reload applies (the layer's per-request settings,
/// the defaults of every route); the others need a restart.
pub const RELOADABLE: &[&str] = &[
    "ttl",
    "lease",
    "wait",
    "share_failure",
    "hold_for",
    "methods",
    "require_key",
    "max_body",
    "retention_limit",
    "scope_header",
];

/// The file's metadata: what the poll compares before it reads the file.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Meta {
    /// A regular file (not a pipe or a device): only those are watched.
    file: bool,
    len: u64,
    modified: Option<SystemTime>,
    /// Device, inode, change time (s, ns): a file renamed over the old
    /// one, or written with its modification time set back, is seen.
    #[cfg(unix)]
    id: (u64, u64, i64, i64),
}

impl Meta {
    fn of(m: &std::fs::Metadata) -> Self {
        #[cfg(unix)]
        use std::os::unix::fs::MetadataExt as _;
        Self {
            file: m.is_file(),
            len: m.len(),
            modified: m.modified().ok(),
            #[cfg(unix)]
            id: (m.dev(), m.ino(), m.ctime(), m.ctime_nsec()),
        }
    }
}

/// What the file looked like when last read.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Stamp {
    meta: Meta,
    /// SHA-256 of the content; `None` for a file larger than
    /// [`MAX_CONFIG_FILE`] (not read: the reload refuses it).
    hash: Option<[u8; 32]>,
}

/// Looks at the file (blocking I/O). When its metadata equal `last`'s,
/// `last` is returned without reading the file; else at most
/// [`MAX_CONFIG_FILE`] + 1 bytes are read and hashed (a file that is not a
/// regular one, such as a pipe, is not read: no hash). `Err`: why it
/// cannot be opened or read.
fn stamp(path: &Path, last: Option<&Stamp>) -> Result<Stamp, String> {
    use std::io::Read as _;
    // The metadata first: opening a named pipe (`--config <(…)`) would
    // wait for a writer. Such a file is never read again by the poll.
    let m = std::fs::metadata(path).map_err(|e| e.to_string())?;
    if m.is_dir() {
        return Err("it is a directory".into());
    }
    if !m.is_file() {
        return Ok(Stamp {
            meta: Meta::of(&m),
            hash: None,
        });
    }
    let file = std::fs::File::open(path).map_err(|e| e.to_string())?;
    let m = file.metadata().map_err(|e| e.to_string())?;
    let meta = Meta::of(&m);
    if let Some(last) = last.filter(|l| l.meta == meta) {
        return Ok(last.clone());
    }
    if meta.len > MAX_CONFIG_FILE {
        return Ok(Stamp { meta, hash: None });
    }
    let mut bytes = Vec::new();
    file.take(MAX_CONFIG_FILE + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| e.to_string())?;
    let hash = (bytes.len() as u64 <= MAX_CONFIG_FILE).then(|| Sha256::digest(&bytes).into());
    Ok(Stamp { meta, hash })
}

/// [`stamp`] on a blocking thread.
async fn look(path: &Path, last: Option<&Stamp>) -> Result<Stamp, String> {
    let (path, last) = (path.to_owned(), last.cloned());
    tokio::task::spawn_blocking(move || stamp(&path, last.as_ref()))
        .await
        .unwrap_or_else(|e| Err(format!("the look at the file failed: {e}")))
}

/// Why a reload happened.
#[derive(Debug, Clone, Copy)]
enum Trigger {
    Signal,
    Changed,
    /// The file can be read again after it could not.
    Back,
}

impl Trigger {
    fn as_str(self) -> &'static str {
        match self {
            Self::Signal => "SIGHUP",
            Self::Changed => "file changed",
            Self::Back => "file readable again",
        }
    }
}

/// Registers the reload metrics at their start values (0 reloads, last
/// success 1).
pub(crate) fn register_metrics() {
    metrics::describe_counter!(
        RELOADS,
        "Reloads of the configuration file (SIGHUP or a change), by result: ok (applied) or error (refused, the running configuration stays)."
    );
    metrics::describe_gauge!(
        LAST_RELOAD_SUCCESS,
        "1 when the last reload of the configuration file (or the start) applied it, 0 when the last reload was refused."
    );
    for result in ["ok", "error"] {
        metrics::counter!(RELOADS, "result" => result).increment(0);
    }
    metrics::gauge!(LAST_RELOAD_SUCCESS).set(1.0);
}

/// Reloads from `source` into `layer` on SIGHUP and on change until `stop`
/// is cancelled; `tokens_served`: whether this process serves `POST
/// /_idem/tokens` (decided at start).
pub(crate) async fn run(
    source: ConfigSource,
    (layer, tokens_served): (IdempotencyLayer, bool),
    stop: CancellationToken,
) {
    #[cfg(unix)]
    let mut hup = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
        Ok(s) => Some(s),
        Err(e) => {
            tracing::warn!(error = %e, "cannot listen for SIGHUP; the configuration file is still reloaded when it changes");
            None
        }
    };
    // After the handler: once the metrics show, SIGHUP reloads (and no
    // longer ends the process).
    register_metrics();
    let path = source.path.clone();
    // What the last reload (or the start) read; `None` while the file
    // cannot be read.
    let mut last = look(&path, None).await.ok();
    // Whether that was reported (once per disappearance).
    let mut unreadable = false;
    let mut tick = tokio::time::interval(POLL_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        #[cfg(unix)]
        let hangup = async {
            match hup.as_mut() {
                Some(s) => {
                    s.recv().await;
                }
                None => std::future::pending::<()>().await,
            }
        };
        #[cfg(not(unix))]
        let hangup = std::future::pending::<()>();
        let trigger = tokio::select! {
            () = stop.cancelled() => return,
            () = hangup => {
                last = look(&path, None).await.ok();
                // A file that cannot be read fails this reload, which
                // reports it; the poll does not report it again.
                unreadable = last.is_none();
                Trigger::Signal
            }
            _ = tick.tick() => {
                let now = match look(&path, last.as_ref()).await {
                    Ok(now) => now,
                    Err(reason) => {
                        if !unreadable {
                            unreadable = true;
                            unreadable_file(&path, &reason);
                        }
                        last = None;
                        continue;
                    }
                };
                if !unreadable && last.as_ref() == Some(&now) {
                    continue;
                }
                if !now.meta.file {
                    // A pipe (`--config <(…)`) or a device is not watched:
                    // it cannot be read twice, and opening a pipe would
                    // wait for a writer.
                    last = Some(now);
                    unreadable = false;
                    continue;
                }
                let Some(settled) = settle(&path, now, &stop).await else {
                    if stop.is_cancelled() {
                        return;
                    }
                    continue;
                };
                let back = std::mem::take(&mut unreadable);
                let same = last.as_ref().is_some_and(|l| l.hash.is_some() && l.hash == settled.hash);
                last = Some(settled);
                if back {
                    Trigger::Back
                } else if same {
                    // Only the content counts: a touch without a change is no reload.
                    continue;
                } else {
                    Trigger::Changed
                }
            }
        };
        reload_once(&source, (&layer, tokens_served), trigger).await;
    }
}

/// Looks at a changed file again every [`SETTLE`] until two looks agree
/// (content and metadata), at most [`SETTLE_TRIES`] times: a file being
/// written in place is applied once its writer is done. `None`: it is
/// still changing, cannot be read any more (the next poll reports it), or
/// `stop` was cancelled.
async fn settle(path: &Path, mut seen: Stamp, stop: &CancellationToken) -> Option<Stamp> {
    for _ in 0..SETTLE_TRIES {
        tokio::select! {
            () = stop.cancelled() => return None,
            () = tokio::time::sleep(SETTLE) => {}
        }
        // Read again whatever the metadata say: a write within the same
        // clock tick keeps the size and the modification time.
        let again = look(path, None).await.ok()?;
        if again == seen {
            return Some(again);
        }
        seen = again;
    }
    tracing::debug!(
        target: "idem",
        file = %path.display(),
        "the configuration file is still changing; looked at again at the next poll"
    );
    None
}

/// Reports a configuration file that cannot be read (once, until it is
/// back): ERROR, a failed reload, the gauge 0.
fn unreadable_file(path: &Path, reason: &str) {
    tracing::error!(
        target: "idem",
        file = %path.display(),
        error = %reason,
        "the configuration file cannot be read (deleted, moved or not readable); the running configuration stays and the file is reloaded when it is back"
    );
    metrics::counter!(RELOADS, "result" => "error").increment(1);
    metrics::gauge!(LAST_RELOAD_SUCCESS).set(0.0);
}

/// One reload (the file read and parsed on a blocking thread); the
/// outcome is logged and counted.
async fn reload_once(
    source: &ConfigSource,
    (layer, tokens_served): (&IdempotencyLayer, bool),
    trigger: Trigger,
) {
    let path = source.path.display().to_string();
    let fail = |reason: String| {
        tracing::error!(
            target: "idem",
            file = %path,
            trigger = trigger.as_str(),
            error = %reason,
            "configuration reload failed; the running configuration stays"
        );
        metrics::counter!(RELOADS, "result" => "error").increment(1);
        metrics::gauge!(LAST_RELOAD_SUCCESS).set(0.0);
    };
    let loaded = {
        let (matches, file) = (source.matches.clone(), source.path.clone());
        tokio::task::spawn_blocking(move || load_for_reload(&matches, &file)).await
    };
    let loaded = match loaded {
        Ok(Ok(l)) => l,
        Ok(Err(e)) => return fail(super::file::error_chain(&e)),
        Err(e) => return fail(format!("the reload task failed: {e}")),
    };
    if loaded.config.tokens_served() && !tokens_served {
        // Its keys could never be had: every request would get 428/403.
        return fail(
            "a route now requires submit tokens, but this gateway does not serve POST \
             /_idem/tokens (it started without --require-token, --issue-tokens or a \
             require_token route); restart it to apply this file"
                .into(),
        );
    }
    let restart: Vec<String> = restart_needed(&source.report, &loaded.report);
    let mut loaded = loaded;
    keep_scoping(&layer.options().scope, &mut loaded.config);
    let mut options = loaded.config.layer.clone();
    options.fail_open = layer.options().fail_open.clone();
    let routes = loaded.config.routes.len();
    let reloaded = match layer.reload(options, loaded.config.routes) {
        Ok(r) => r,
        Err(e) => return fail(e.to_string()),
    };
    if !reloaded.rekeyed.is_empty() {
        tracing::warn!(
            target: "idem",
            file = %path,
            routes = %reloaded.rekeyed.join(","),
            "configuration reload changed the scope or the key source of these routes: results stored before are not found by retries, which run again"
        );
    }
    if !restart.is_empty() {
        tracing::warn!(
            target: "idem",
            file = %path,
            settings = %restart.join(","),
            "configuration reload: these settings need a restart and were not applied"
        );
    }
    tracing::info!(
        target: "idem",
        file = %path,
        trigger = trigger.as_str(),
        routes,
        "configuration reloaded"
    );
    metrics::counter!(RELOADS, "result" => "ok").increment(1);
    metrics::gauge!(LAST_RELOAD_SUCCESS).set(1.0);
}

/// `scope_from` (client certificate or headers) needs a restart: when the
/// file now says otherwise than the running gateway, the layer and every
/// route keep the scope the gateway started with (`running`), and the
/// restart WARN names `scope_from`. Applying it would scope requests by a
/// certificate the listener does not ask for, or drop certificate scoping
/// for header values a caller chooses.
fn keep_scoping(running: &ScopeBy, config: &mut super::GatewayConfig) {
    let by_cert = |s: &ScopeBy| *s == ScopeBy::ClientCert;
    if by_cert(running) == by_cert(&config.layer.scope) {
        return;
    }
    config.layer.scope = running.clone();
    for route in &mut config.routes {
        route.options.scope = running.clone();
    }
}

/// The top-level keys outside [`RELOADABLE`] whose effective value differs
/// between `running` and `new`.
pub fn restart_needed(running: &Report, new: &Report) -> Vec<String> {
    new.settings
        .iter()
        .filter(|s| !RELOADABLE.contains(&s.key.as_str()))
        .filter(|s| running.value(&s.key) != Some(s.value.as_str()))
        .map(|s| s.key.clone())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::file::{Setting, Source};

    fn report(pairs: &[(&str, &str)]) -> Report {
        Report {
            settings: pairs
                .iter()
                .map(|(k, v)| Setting {
                    key: (*k).into(),
                    value: (*v).into(),
                    source: Source::Default,
                })
                .collect(),
            routes: Vec::new(),
        }
    }

    #[test]
    fn restart_settings_are_named() {
        let a = report(&[
            ("listen", "127.0.0.1:1"),
            ("ttl", "1h"),
            ("store", "memory://"),
        ]);
        let b = report(&[
            ("listen", "127.0.0.1:2"),
            ("ttl", "2h"),
            ("store", "memory://"),
        ]);
        assert_eq!(restart_needed(&a, &b), vec!["listen"]);
        assert!(restart_needed(&a, &a).is_empty());
    }

    #[test]
    fn tls_and_scope_from_need_a_restart() {
        for k in ["tls_cert", "tls_key", "tls_client_ca", "scope_from"] {
            assert!(!RELOADABLE.contains(&k), "{k}");
            let a = report(&[(k, "a")]);
            let b = report(&[(k, "b")]);
            assert_eq!(restart_needed(&a, &b), vec![k.to_owned()]);
        }
    }

    #[test]
    fn a_reload_keeps_the_running_way_of_scoping() {
        let mut c = super::super::GatewayConfig::new("http://127.0.0.1:1".parse().unwrap());
        let route = idem_http::Route::new("r", "/r", c.layer.clone()).unwrap();
        c.routes.push(route);
        // Running by certificate, the file now by headers: kept.
        keep_scoping(&ScopeBy::ClientCert, &mut c);
        assert_eq!(c.layer.scope, ScopeBy::ClientCert);
        assert_eq!(c.routes[0].options.scope, ScopeBy::ClientCert);
        // Running by headers, the file now by certificate: the start's headers.
        let start = ScopeBy::Headers(vec![http::HeaderName::from_static("x-api-key")]);
        keep_scoping(&start, &mut c);
        assert_eq!(c.layer.scope, start);
        assert_eq!(c.routes[0].options.scope, start);
        // The same way of scoping: the file's (reloadable) headers apply.
        let other = ScopeBy::Headers(vec![http::HeaderName::from_static("x-tenant")]);
        c.layer.scope = other.clone();
        keep_scoping(&start, &mut c);
        assert_eq!(c.layer.scope, other);
    }

    #[test]
    fn stamps_see_content() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f.toml");
        std::fs::write(&p, "a = 1").unwrap();
        let s1 = stamp(&p, None).unwrap();
        assert!(s1.hash.is_some());
        // Unchanged metadata: the last stamp, the file not read.
        assert_eq!(stamp(&p, Some(&s1)).unwrap(), s1);
        std::fs::write(&p, "a = 2").unwrap();
        assert_ne!(stamp(&p, None).unwrap().hash, s1.hash);
        assert!(stamp(&dir.path().join("missing"), None).is_err());
        assert!(stamp(dir.path(), None).is_err(), "a directory");
    }

    #[test]
    fn a_large_file_is_not_hashed() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("big.toml");
        let f = std::fs::File::create(&p).unwrap();
        f.set_len(MAX_CONFIG_FILE + 1).unwrap();
        let s = stamp(&p, None).unwrap();
        assert_eq!((s.meta.len, s.hash), (MAX_CONFIG_FILE + 1, None));
    }

    #[tokio::test]
    async fn a_file_still_being_written_is_not_settled() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f.toml");
        std::fs::write(&p, "a = 1\n").unwrap();
        let stop = CancellationToken::new();
        let first = stamp(&p, None).unwrap();
        let settled = settle(&p, first.clone(), &stop).await.unwrap();
        assert_eq!(
            settled, first,
            "an unchanged file settles at the first look"
        );
        // A writer appending every 100 ms: never two looks alike.
        let writer = {
            let p = p.clone();
            std::thread::spawn(move || {
                use std::io::Write as _;
                let mut f = std::fs::OpenOptions::new().append(true).open(&p).unwrap();
                for i in 0..30 {
                    writeln!(f, "# line {i}").unwrap();
                    std::thread::sleep(Duration::from_millis(100));
                }
            })
        };
        let moving = stamp(&p, None).unwrap();
        assert!(settle(&p, moving, &stop).await.is_none());
        writer.join().unwrap();
        stop.cancel();
        assert!(settle(&p, first, &stop).await.is_none(), "stopped");
    }
}
