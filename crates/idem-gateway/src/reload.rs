//! Hot reload of the configuration file: on SIGHUP, and when the file
//! changes (its size, modification time and SHA-256 are read every second,
//! which also sees editors that write a new file and rename it over the
//! old one).
//!
//! A reload reads the file again and layers it under the same command line
//! and environment as at start ([`crate::config_file::load`]), then
//! validates the whole configuration. A good one replaces the routes and
//! the per-request settings of the layer ([`RELOADABLE`];
//! [`idem_http::IdempotencyLayer::reload`]): requests in flight finish
//! under the rules they started with, and no connection is dropped; INFO
//! `configuration reloaded` with the route count. A bad one changes
//! nothing: ERROR `configuration reload failed` with the reason (and the
//! line); `/_idem/ready` is not affected. Settings that need a restart (the
//! listener, the store, the upstream, the admin listener, limits and
//! timeouts of the gateway itself: every top-level key not in
//! [`RELOADABLE`]) that changed are named in a WARN and not applied.
//!
//! Metrics: [`RELOADS`] `idem_config_reloads_total{result="ok"|"error"}`
//! and [`LAST_RELOAD_SUCCESS`] `idem_config_last_reload_success` (1 or 0).

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use clap::ArgMatches;
use idem_http::IdempotencyLayer;
use sha2::{Digest, Sha256};
use tokio_util::sync::CancellationToken;

use crate::config_file::{load, Report};

/// Counter of reloads by result, label `result` = `ok` | `error`.
pub const RELOADS: &str = "idem_config_reloads_total";
/// Gauge: 1 when the last reload (or the start) applied the file, 0 when
/// the last reload was refused.
pub const LAST_RELOAD_SUCCESS: &str = "idem_config_last_reload_success";
/// How often the file is looked at: every 1 s.
pub const POLL_INTERVAL: Duration = Duration::from_secs(1);

/// The top-level keys a reload applies (the layer's per-request settings,
/// the defaults of every route); the others need a restart.
pub const RELOADABLE: &[&str] = &[
    "ttl",
    "lease",
    "wait",
    "methods",
    "require_key",
    "max_body",
    "retention_limit",
    "scope_header",
];

/// Where the running configuration came from: the file, the command line
/// it was layered under, and what it gave at start. Its `Debug` shows the
/// path only (the command line may hold a store password).
#[derive(Clone)]
pub struct ConfigSource {
    /// The configuration file.
    pub path: PathBuf,
    /// The command line as clap parsed it (the arguments of `idem gateway`).
    pub matches: ArgMatches,
    /// The effective settings at start.
    pub report: Report,
}

impl std::fmt::Debug for ConfigSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConfigSource")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

/// What the file looked like when last read.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Stamp {
    len: u64,
    modified: Option<SystemTime>,
    hash: [u8; 32],
}

fn stamp(path: &Path) -> Option<Stamp> {
    let meta = std::fs::metadata(path).ok()?;
    let bytes = std::fs::read(path).ok()?;
    Some(Stamp {
        len: meta.len(),
        modified: meta.modified().ok(),
        hash: Sha256::digest(&bytes).into(),
    })
}

/// Why a reload happened.
#[derive(Debug, Clone, Copy)]
enum Trigger {
    Signal,
    Changed,
}

impl Trigger {
    fn as_str(self) -> &'static str {
        match self {
            Self::Signal => "SIGHUP",
            Self::Changed => "file changed",
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
    let mut last = stamp(&source.path);
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
            () = hangup => Trigger::Signal,
            _ = tick.tick() => {
                let now = stamp(&source.path);
                if now.is_none() || now == last {
                    continue;
                }
                // Only the content counts: a touch without a change is no reload.
                if now.as_ref().map(|s| s.hash) == last.as_ref().map(|s| s.hash) {
                    last = now;
                    continue;
                }
                last = now;
                Trigger::Changed
            }
        };
        if matches!(trigger, Trigger::Signal) {
            last = stamp(&source.path);
        }
        reload_once(&source, (&layer, tokens_served), trigger);
    }
}

/// One reload; the outcome is logged and counted.
fn reload_once(
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
    let loaded = match load(&source.matches, &source.path) {
        Ok(l) => l,
        Err(e) => return fail(crate::config_file::error_chain(&e)),
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
    use crate::config_file::{Setting, Source};

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
    fn stamps_see_content() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f.toml");
        std::fs::write(&p, "a = 1").unwrap();
        let s1 = stamp(&p).unwrap();
        std::fs::write(&p, "a = 2").unwrap();
        assert_ne!(stamp(&p).unwrap().hash, s1.hash);
        assert!(stamp(&dir.path().join("missing")).is_none());
    }
}
